"""Readers of the NP benchmarks' data: the fixed-seed GP evaluation set, image datasets, the wheel bandit."""
