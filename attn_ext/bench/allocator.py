"""Reuse of freed memory during a benchmark's timings, so that they measure the op and not the OS.

glibc serves every allocation above its mmap threshold (at most 32 MB) with fresh ``mmap``'d pages
and unmaps them on free, so each call of an op with a large output pays the first-touch page faults
of that output again. On this machine's VM that is about 1 GB/s: zero-filling a fresh 224 MB tensor
takes 231 ms, against 0.7 ms for an 18 MB one served from the heap. A time-per-element check that
crosses 32 MB then measures the allocator, not the op. Inside :func:`heap_reuse` the heap serves
every size and is never trimmed, as a caching allocator (PyTorch's on GPU, jemalloc or tcmalloc on
CPU) would; on exit glibc's steady-state thresholds are set and the retained memory returned.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import platform
import sys
from typing import Iterator, Optional

# mallopt parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
#: What glibc's dynamic thresholds settle to once a block of 32 MB or more has been freed, and its
#: default cap on mmap'd blocks; restored on exit (setting any threshold ends the dynamic adjustment).
_STEADY_MMAP_THRESHOLD, _STEADY_TRIM_THRESHOLD, _DEFAULT_MMAP_MAX = 32 * 2**20, 64 * 2**20, 65536

HEAP_REUSE_TEXT = ("freed memory reused: glibc `mallopt(M_MMAP_MAX, 0)` and `mallopt(M_TRIM_THRESHOLD, -1)` "
                   "during the timings, so that calls do not pay first-touch page faults of fresh mmap'd outputs "
                   "(see attn_ext/bench/allocator.py)")


def _glibc() -> Optional[ctypes.CDLL]:
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@contextlib.contextmanager
def heap_reuse() -> Iterator[Optional[str]]:
    """Serve every allocation from the (never trimmed) heap while the block runs.

    Yields :data:`HEAP_REUSE_TEXT` for the report, or None where the C library is not glibc (the
    timings then run with the default allocator, and the report says so).
    """
    libc = _glibc()
    if libc is None or not (libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, -1)):
        yield None
        return
    try:
        yield HEAP_REUSE_TEXT
    finally:
        libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
        libc.mallopt(_M_MMAP_THRESHOLD, _STEADY_MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, _STEADY_TRIM_THRESHOLD)
        libc.malloc_trim(0)
