"""How the GPU benchmarks time a call: CUDA events, a median, the peak memory, the time a row may take,
and Triton's autotuning.

:func:`cuda_time` times a zero-argument callable on the current stream with CUDA events, after warm-up
calls, repeating it as many times as fit in a small time budget (between ``min_repeats`` and
``max_repeats``), and reports the median and the peak of ``torch.cuda.max_memory_allocated`` above what
was allocated before (the call's outputs and workspace; the inputs are not counted). A call slower than
``max_call_s`` is timed once and not sampled (:class:`TooSlow`): a few slow rows (the ``cuda`` backend's
fp16 attention at 16k tokens took 0.26-3.7 s per call on an H200) would otherwise spend the minutes a
short GPU window has.
:class:`Budget` holds those limits for a whole run, with the best rate measured so far per kind of call,
so that a call predicted over the limit is not even made once.

Triton autotunes a kernel on its first call for each new key (tiles, shapes, dtype): it compiles every
configuration the pruning keeps and times each with ``triton.testing.do_bench``, which makes at least 8
calls per configuration (one, five to estimate, one or more of warm-up, one or more timed), whatever their
length. At 16k tokens one forward and backward takes 0.21 s with the tiles the tuning chose (H200,
2026-11-28) and several times that with the small ones, so tuning a case's three kernels over their 15-16
configurations each cost most of a minute: the bf16 D=128 N=16384 case took 61.5 s on that H200 after a
warm-up had compiled its Triton kernels (FlexAttention's compile for that shape included), the N=4096 one
12 s. :func:`quick_autotuning` times each configuration with :func:`tuning_bench` instead: one untimed call
(its compile or load), then timed calls for 20 ms, at least one (2 calls for a slow configuration, about 20
for a 1 ms one), ranked by their median. The compiles themselves are done beforehand in parallel processes
(:mod:`bench.gpu.warm`), which use :func:`compile_only_autotuning`.
"""
from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch

#: Milliseconds of timed calls per configuration of Triton's autotuner in the timing process (at least one call).
AUTOTUNE_REP_MS = 20
#: Most timed calls per configuration (a call of microseconds would otherwise make thousands).
AUTOTUNE_MAX_SAMPLES = 100
#: Bytes written between timed calls of a configuration, as do_bench does: the H200's L2 is 60 MB.
L2_FLUSH_BYTES = 256 * 2**20
#: Longest call the benchmark samples (seconds): with at least 3 samples and one warm-up call after the
#: check, a row then costs at most about 5 s.
MAX_CALL_S = 1.0
#: The note of a row left for lack of time.
TIME_LIMIT_NOTE = "not measured: time limit of the bench stage"


@dataclass(frozen=True)
class GpuTiming:
    """Result of :func:`cuda_time`: the median and every sample (ms per call), and the peak memory (MiB)."""

    median_ms: float
    samples_ms: tuple[float, ...]
    peak_mib: float


class TooSlow(Exception):
    """One call took longer than the limit per call: it was timed once and not sampled."""

    def __init__(self, seconds: float, limit_s: float):
        self.seconds, self.limit_s = seconds, limit_s
        super().__init__(f"one call took {seconds:.2f} s, over the limit of {limit_s:g} s per call")


def warm_up(sample: Callable[[], float], warmup: int, budget_s: float, max_call_s: float | None,
            number: int = 1) -> list[float]:
    """Runs ``sample`` (``number`` calls, returns ms per call) ``warmup`` times at most, and at least once;
    stops once the samples together took ``budget_s`` (calls that slow have nothing left to warm); raises
    :class:`TooSlow` when a call took more than ``max_call_s``. Returns the warm-up samples."""
    taken: list[float] = []
    while not taken or (len(taken) < warmup and sum(taken) * number < budget_s * 1e3):
        taken.append(sample())
        if max_call_s is not None and taken[-1] > max_call_s * 1e3:
            raise TooSlow(taken[-1] / 1e3, max_call_s)
    return taken


def repeats(first_ms: float, number: int, min_repeats: int, max_repeats: int, budget_s: float) -> int:
    """How many samples fit in ``budget_s`` given the first one (``number`` calls of ``first_ms`` each)."""
    return max(min_repeats, min(max_repeats, int(budget_s * 1e3 / max(first_ms * number, 1e-3))))


def cuda_time(fn: Callable[[], object], *, number: int = 1, warmup: int = 2, min_repeats: int = 3,
              max_repeats: int = 20, budget_s: float = 0.25, max_call_s: float | None = None) -> GpuTiming:
    """Median over repeats of the time of ``number`` back-to-back calls of ``fn`` (divided by ``number``),
    timed with CUDA events, after up to ``warmup`` warm-up samples (:func:`warm_up`); the repeats are as
    many as fit in ``budget_s`` (bounded as above). Raises :class:`TooSlow` after one warm-up sample whose
    calls took more than ``max_call_s`` each: the caller's first call (its check) has already compiled."""

    def sample() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(number):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / number

    warm_up(sample, warmup, budget_s, max_call_s, number)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    samples = [sample()]
    samples += [sample() for _ in range(repeats(samples[0], number, min_repeats, max_repeats, budget_s) - 1)]
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return GpuTiming(statistics.median(samples), tuple(samples), peak)


@dataclass
class Budget:
    """What a benchmark run may spend: the ``deadline`` (``time.monotonic()``) after which no row starts,
    the longest call it samples (``max_call_s``), and the best rate measured so far per kind of call
    (a key the section chooses), from which :meth:`too_slow` predicts a call's time before making it."""

    deadline: float
    max_call_s: float = MAX_CALL_S
    best_rates: dict[Hashable, tuple[float, str]] = field(default_factory=dict)

    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def record(self, key: Hashable, flops: float, ms: float, where: str) -> None:
        """Keeps ``flops / ms`` as the rate of ``key`` if it is the best so far (measured on ``where``)."""
        rate = flops / (ms * 1e-3)
        if rate > self.best_rates.get(key, (0.0, ""))[0]:
            self.best_rates[key] = (rate, where)

    def too_slow(self, key: Hashable, flops: float) -> str | None:
        """Why a call of ``flops`` of kind ``key`` is not made: its time at the best rate measured so far
        is over ``max_call_s`` (the best rate, so the prediction errs towards making the call); else None."""
        if key not in self.best_rates:
            return None
        rate, where = self.best_rates[key]
        seconds = flops / rate
        if seconds <= self.max_call_s:
            return None
        return (f"predicted {seconds:.1f} s per call at {rate / 1e12:.1f} TFLOP/s (the best rate "
                f"measured so far, on {where}), over the limit of {self.max_call_s:g} s per call")


def _set_benchmarker(benchmarker) -> str | None:
    """Makes every Triton autotuner created from now on time configurations with ``benchmarker``;
    None on success, else why not (Triton's internals differ between versions: then the default stays)."""
    try:
        from triton.runtime import driver  # Triton is optional: this module imports without it

        driver.active.get_benchmarker = lambda: benchmarker
    except Exception as exc:  # noqa: BLE001 - a missing internal only costs time
        return f"{type(exc).__name__}: {exc}"
    return None


def quantiles_of(samples: list[float], quantiles=None):
    """What a Triton benchmarker returns: the median of ``samples``, or the list of their ``quantiles``
    (linear interpolation between the sorted samples, as ``torch.quantile``)."""
    if quantiles is None:
        return statistics.median(samples)
    ordered = sorted(samples)

    def quantile(q: float) -> float:
        position = q * (len(ordered) - 1)
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    return [quantile(q) for q in quantiles]


def tuning_bench(kernel_call: Callable[[], object], quantiles=None, *, rep_ms: float = AUTOTUNE_REP_MS,
                 max_samples: int = AUTOTUNE_MAX_SAMPLES, clock: Callable | None = None, flush=None, **_ignored):
    """Times one configuration for Triton's autotuner (``do_bench``'s signature): one untimed call, which
    compiles or loads it, then timed calls (``clock(kernel_call)``, ms; default CUDA events) until
    ``rep_ms`` is spent, at least one and at most ``max_samples``; ``flush()`` (default: write
    :data:`L2_FLUSH_BYTES`) before each, so that no call finds its inputs in the L2. Returns the median,
    or ``quantiles`` of the samples."""
    clock = clock or _event_ms
    flush = flush or _flush_l2
    kernel_call()
    samples: list[float] = []
    while not samples or (sum(samples) < rep_ms and len(samples) < max_samples):
        flush()
        samples.append(clock(kernel_call))
    return quantiles_of(samples, quantiles)


def _event_ms(fn: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


@functools.lru_cache(maxsize=None)
def _l2_buffer() -> torch.Tensor:
    return torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")


def _flush_l2() -> None:
    _l2_buffer().zero_()


def quick_autotuning() -> str | None:
    """Autotuning that times each configuration with :func:`tuning_bench` (see the module docstring)."""
    return _set_benchmarker(tuning_bench)


def compile_only_autotuning() -> str | None:
    """Autotuning that runs each configuration once and ranks none: the compiles land in Triton's on-disk
    cache for the timing process, which tunes for itself. For :mod:`bench.gpu.warm` only."""

    def once(kernel_call, quantiles=None, **_):
        kernel_call()
        return [1.0, 1.0, 1.0] if quantiles else 1.0

    return _set_benchmarker(once)
