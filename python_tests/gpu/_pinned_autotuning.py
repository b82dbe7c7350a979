"""Under ``ATTN_EXT_TRITON_PIN=1`` on a GPU, Triton's autotuners time nothing: each call has one candidate.

Pinned, an autotuned kernel with a pruning keeps all its configs and lets the pruning choose one per call
(``attn_ext.ops.utils.triton.tuning_plan``). Triton 3.9 runs a lone survivor without timing it; Triton 3.6 (the
H200 machine's, 2026-11-28) still times it with ``triton.testing.do_bench`` on every new tuning key of every
test process: 5 estimating calls, then 25 ms of warm-up and 100 ms of timed calls, each timed call after
clearing the L2 by writing 256 MB. For a test's microsecond kernel that is about 1,400 launches and 0.1 s of the
GPU per kernel and key, on the one GPU that the 16 test processes of the tests stage share, and under
compute-sanitizer dozens of instrumented launches. Timing one candidate chooses nothing: here it runs once.
"""
from __future__ import annotations

import os

import torch

from attn_ext.ops.utils.triton import PIN_ENV


def run_once(kernel_call, quantiles=None, **_ignored):
    """A benchmarker for Triton's autotuner that launches the one candidate once and times nothing."""
    kernel_call()
    return [0.0] * len(quantiles) if quantiles else 0.0


def untimed_when_pinned() -> bool:
    """Makes Triton's autotuners use :func:`run_once` when the tiles are pinned and the kernels run on a GPU;
    whether it did."""
    if os.environ.get(PIN_ENV) != "1" or os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return False
    try:
        from triton.runtime import driver  # Triton is optional: without it the Triton tests skip
    except ImportError:
        return False
    driver.active.get_benchmarker = lambda: run_once
    return True
