"""Pieces every op family shares: dtype rules, argument checks, the compiled extension, custom-op
registration, backend dispatch and Triton helpers."""
