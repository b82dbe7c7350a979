"""How the GPU benchmarks time a call: CUDA events, a median, the peak memory, and Triton's autotuning.

:func:`cuda_time` times a zero-argument callable on the current stream with CUDA events, after warm-up
calls, repeating it as many times as fit in a small time budget (between ``min_repeats`` and
``max_repeats``), and reports the median and the peak of ``torch.cuda.max_memory_allocated`` above what
was allocated before (the call's outputs and workspace; the inputs are not counted).

Triton autotunes a kernel on its first call for each new key (tiles, shapes, dtype): it compiles every
configuration the pruning keeps and times each with ``triton.testing.do_bench`` (25 ms of warm-up and
100 ms of repeats per configuration by default). For the dozens of keys of the benchmark grid that is
minutes, so :func:`shorter_autotuning` makes each configuration's timing 5 ms + 20 ms (enough to rank
tiles whose times differ by more than a few per cent), and the compiles are done beforehand in parallel
processes (:mod:`bench.gpu.warm`), which use :func:`compile_only_autotuning`.
"""
from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass
from typing import Callable

import torch

#: Per-configuration timing of Triton's autotuner in the timing process (milliseconds).
AUTOTUNE_WARMUP_MS, AUTOTUNE_REP_MS = 5, 20


@dataclass(frozen=True)
class GpuTiming:
    """Result of :func:`cuda_time`: the median and every sample (ms per call), and the peak memory (MiB)."""

    median_ms: float
    samples_ms: tuple[float, ...]
    peak_mib: float


def cuda_time(fn: Callable[[], object], *, number: int = 1, warmup: int = 2, min_repeats: int = 3,
              max_repeats: int = 20, budget_s: float = 0.25) -> GpuTiming:
    """Median over repeats of the time of ``number`` back-to-back calls of ``fn`` (divided by ``number``),
    timed with CUDA events; the repeats are as many as fit in ``budget_s`` (bounded as above)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()

    def sample() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(number):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / number

    samples = [sample()]
    repeats = max(min_repeats, min(max_repeats, int(budget_s * 1e3 / max(samples[0] * number, 1e-3))))
    samples += [sample() for _ in range(repeats - 1)]
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return GpuTiming(statistics.median(samples), tuple(samples), peak)


def _set_benchmarker(benchmarker) -> str | None:
    """Makes every Triton autotuner created from now on time configurations with ``benchmarker``;
    None on success, else why not (Triton's internals differ between versions: then the default stays)."""
    try:
        from triton.runtime import driver  # Triton is optional: this module imports without it

        driver.active.get_benchmarker = lambda: benchmarker
    except Exception as exc:  # noqa: BLE001 - a missing internal only costs time
        return f"{type(exc).__name__}: {exc}"
    return None


def shorter_autotuning() -> str | None:
    """Autotuning with 5 ms of warm-up and 20 ms of repeats per configuration (see the module docstring)."""
    from triton.testing import do_bench  # Triton is optional: this module imports without it

    return _set_benchmarker(functools.partial(do_bench, warmup=AUTOTUNE_WARMUP_MS, rep=AUTOTUNE_REP_MS))


def compile_only_autotuning() -> str | None:
    """Autotuning that runs each configuration once and ranks none: the compiles land in Triton's on-disk
    cache for the timing process, which tunes for itself. For :mod:`bench.gpu.warm` only."""

    def once(kernel_call, quantiles=None, **_):
        kernel_call()
        return [1.0, 1.0, 1.0] if quantiles else 1.0

    return _set_benchmarker(once)
