"""Tests of the harness (python -m bench): timing, reports, goals, the NP training and evaluation CLI."""
