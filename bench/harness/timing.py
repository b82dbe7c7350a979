"""Wall-clock timing of zero-argument callables: warm-up, then the median of repeats."""

from __future__ import annotations

import gc
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch


@dataclass(frozen=True)
class Timing:
    """Result of :func:`time_interleaved` for one function.

    Attributes
    ----------
    median_ms : float
        Median of ``samples_ms``.
    samples_ms : tuple of float
        One wall-clock time per repeat (per call: the mean over ``number``
        calls), in milliseconds, in the order measured.
    """

    median_ms: float
    samples_ms: tuple[float, ...]


def median_ms(t: "Timing | Exception") -> float | None:
    """The median of a :func:`time_interleaved` result, None for a function that raised."""
    return None if isinstance(t, Exception) else t.median_ms


#: Warm-up: at least this many seconds of untimed rounds (and at least ``warmup`` rounds).
MIN_WARMUP_S = 0.5
#: At most this many warm-up rounds, however short the calls.
MAX_WARMUP_ROUNDS = 50
#: At most this many timed rounds when ``min_timed_s`` asks for more than ``repeats``.
MAX_TIMED_ROUNDS = 200
WARMUP_TEXT = f"at least {MIN_WARMUP_S:g} s of warm-up"


def time_interleaved(
    fns: Mapping[str, Callable[[], object]], repeats: int = 5, warmup: int = 1, number: int = 1,
    min_warmup_s: float = MIN_WARMUP_S, min_timed_s: float = 0.0,
) -> dict[str, Timing | Exception]:
    """Time several callables with their repeats interleaved.

    On a shared machine the background load drifts over seconds; timing A's
    repeats and then B's would charge that drift to the A/B ratio. Here every
    round calls each function once, rotating the order from round to round so
    none is always first after a pause.

    Parameters
    ----------
    fns : mapping of str to callable
        Zero-argument callables, by name.
    repeats : int
        Timed calls per function (>= 1); the median is reported because one
        scheduler hiccup on a 2-core machine would otherwise skew a mean.
    warmup : int
        Untimed rounds first, so one-off costs (thread-pool start-up,
        first-touch page faults, lazy kernel selection) are not timed.
    min_warmup_s : float
        The warm-up rounds go on until they have taken at least this long
        (at most :data:`MAX_WARMUP_ROUNDS` rounds): on this machine calls of a
        few ms take ~10 calls to settle (allocator and OpenMP pool state),
        for torch's ops and ours alike, and one round would time that.
    min_timed_s : float
        The timed rounds go on past ``repeats`` until the timed calls of all
        functions together have taken at least this long (at most
        :data:`MAX_TIMED_ROUNDS` rounds). For calls of a few
        ms, five samples span well under a second, and one burst of background
        load then moves the median; spreading the samples over seconds does not.
    number : int
        Back-to-back calls per sample, which is their mean (as in ``timeit``).
        For sub-millisecond calls, so that the cache eviction by the
        ``gc.collect`` before each sample is not charged to a single call.

    Returns
    -------
    dict
        Name -> :class:`Timing`, or the exception the function raised; a failing
        function is dropped from later rounds and does not stop the others.
    """
    if repeats < 1 or number < 1:
        raise ValueError(f"repeats and number must be >= 1, got {repeats} and {number}")
    names = list(fns)
    failed: dict[str, Exception] = {}
    samples: dict[str, list[float]] = {name: [] for name in names}

    def call(name: str, timed: bool) -> None:
        # A collection triggered inside the timed region would be charged to fns[name].
        gc.collect()
        try:
            start = time.perf_counter()
            for _ in range(number - 1):
                fns[name]()
            result = fns[name]()
            elapsed = (time.perf_counter() - start) * 1e3 / number
        except Exception as exc:  # noqa: BLE001 - reported to the caller per function
            failed[name] = exc
            return
        del result  # so the next call does not run while this output is still alive
        if timed:
            samples[name].append(elapsed)

    warmup_start, rounds = time.perf_counter(), 0
    while rounds < warmup or (time.perf_counter() - warmup_start < min_warmup_s and rounds < MAX_WARMUP_ROUNDS):
        for name in names:
            if name not in failed:
                call(name, timed=False)
        rounds += 1
    def timed_seconds() -> float:  # the calls' own time, not the collections between them
        return sum(sum(samples[name]) * number for name in names) / 1e3

    r = 0
    while r < repeats or (timed_seconds() < min_timed_s and r < MAX_TIMED_ROUNDS):
        for name in names[r % len(names):] + names[: r % len(names)]:
            if name not in failed:
                call(name, timed=True)
        r += 1
    return {
        name: failed[name] if name in failed
        else Timing(median_ms=statistics.median(samples[name]), samples_ms=tuple(samples[name]))
        for name in names
    }


@contextmanager
def torch_threads(count: int | None) -> Iterator[int]:
    """Run the block with ``count`` torch threads (None: as they are) and restore the previous count.

    ``python -m bench run`` runs every benchmark in one process: a benchmark that left the count changed
    would time all the later ones, and label them, with the wrong number of threads. Yields the count
    in force inside the block.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(count or previous)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)


@contextmanager
def gc_frozen() -> Iterator[None]:
    """Run the block with every object alive at its start hidden from the garbage collector (``gc.freeze``),
    visible again after it.

    :func:`time_interleaved` collects before every sample, so that no collection lands in a timed region.
    In a process that has imported torch and attn_ext (about 300k objects, Triton's bindings among them)
    one full collection takes ~0.14 s on this machine: for samples of milliseconds, most of a benchmark's
    wall time. With those objects frozen it takes microseconds and still frees everything the timed calls
    create; an automatic full collection inside a sample becomes as cheap.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
