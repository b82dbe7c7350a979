"""Peak extra memory of one call, measured in a fresh subprocess.

Method (Linux): the child starts with ``MALLOC_MMAP_THRESHOLD_=65536`` so glibc
serves every large block by ``mmap`` and gives it back on ``free``; resident set
size (RSS) then tracks live tensor memory closely. The child builds the inputs,
makes one warm-up call, resets the kernel's peak-RSS counter by writing ``5`` to
``/proc/self/clear_refs``, reads ``VmRSS``, makes the measured call and reads
``VmHWM``. ``VmHWM - VmRSS`` is the peak extra memory of the call, *including
its output*.

If the peak counter cannot be reset, the child falls back to
``torch.profiler`` (``profile_memory=True``) and replays the allocator events of
the call (this sees only tensor allocations of the c10 CPU allocator). If that
fails too, the result is ``n/a`` with the reason; nothing here raises.

Child protocol: ``python -m bench.harness.memory MODULE:FUNCTION JSON_KWARGS
[--method auto|rss|profiler]``. ``MODULE.FUNCTION(**kwargs)`` builds the inputs
and returns a zero-argument callable; the child prints one JSON line last.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"
# Above this, large blocks come from mmap and go back to the kernel on free.
_MMAP_THRESHOLD = "65536"
# Slack when checking that the peak counter really was reset (page-table noise).
_RESET_SLACK_KB = 1024


@dataclass(frozen=True)
class PeakMemory:
    """Peak extra memory of one call.

    Attributes
    ----------
    extra_bytes : int or None
        Peak memory above the level before the call, output included; ``None``
        when it could not be measured.
    method : str
        ``"rss"`` (VmHWM after a clear_refs reset), ``"torch.profiler"`` or ``"n/a"``.
    note : str
        Why the fallback was taken or why the value is missing; empty otherwise.
    """

    extra_bytes: int | None
    method: str
    note: str = ""

    @property
    def mb(self) -> float | None:
        """Peak extra memory in MB (10**6 bytes), or None."""
        return None if self.extra_bytes is None else self.extra_bytes / 1e6


def measure_peak_extra(
    target: str, kwargs: dict, method: str = "auto", timeout: float = 1800.0
) -> PeakMemory:
    """Measure the peak extra memory of one call in a fresh subprocess.

    Parameters
    ----------
    target : str
        ``"module:function"``; ``function(**kwargs)`` must build its inputs and
        return a zero-argument callable that makes the call to measure.
    kwargs : dict
        JSON-serialisable keyword arguments for ``function``.
    method : {"auto", "rss", "profiler"}
        ``"auto"`` tries RSS first, then the profiler. The others force one
        method (used to cross-check them).
    timeout : float
        Seconds before the child is abandoned (reported as ``n/a``).

    Returns
    -------
    PeakMemory
        Never raises for a failing child; the failure is in ``note``.
    """
    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = _MMAP_THRESHOLD
    # The child must import this very harness (run from a clone, never installed) and the attn_ext the
    # parent measures, wherever either was imported from.
    paths = [str(Path(__file__).resolve().parents[2])]
    if "attn_ext" in sys.modules:
        paths.append(str(Path(sys.modules["attn_ext"].__file__).resolve().parents[1]))
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in (*paths, env.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "bench.harness.memory", target, json.dumps(kwargs), "--method", method]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:
        return PeakMemory(None, "n/a", f"memory probe did not run: {exc}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return PeakMemory(None, "n/a", f"memory probe failed (exit {proc.returncode}): {tail}")
    try:
        data = json.loads(lines[-1])
        return PeakMemory(data["extra_bytes"], data["method"], data.get("note", ""))
    except (ValueError, KeyError, TypeError) as exc:
        return PeakMemory(None, "n/a", f"unreadable memory probe output: {exc}")


def _status_kb(field: str) -> int:
    with open(_STATUS) as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} missing from {_STATUS}")


def _reset_peak_rss() -> str | None:
    """Reset VmHWM to the current RSS; return why it failed, or None."""
    try:
        with open(_CLEAR_REFS, "w") as fh:
            fh.write("5")
        rss, hwm = _status_kb("VmRSS"), _status_kb("VmHWM")
    except OSError as exc:
        return f"cannot reset peak RSS via {_CLEAR_REFS}: {exc}"
    # Some kernels accept the write but ignore it; trust the counter only if it moved.
    if hwm > rss + _RESET_SLACK_KB:
        return f"{_CLEAR_REFS} accepted but VmHWM ({hwm} kB) stayed above VmRSS ({rss} kB)"
    return None


def _measure_rss(run: Callable[[], object]) -> dict:
    before_kb = _status_kb("VmRSS")
    out = run()
    peak_kb = _status_kb("VmHWM")
    del out
    return {"extra_bytes": max(0, peak_kb - before_kb) * 1024, "method": "rss", "note": ""}


def _measure_profiler(run: Callable[[], object], note: str) -> dict:
    # torch's private API, imported here rather than at the top: if another torch version moves it, the
    # ImportError lands in _child's broad except (a result of n/a) instead of breaking this module's import.
    from torch._C._profiler import _EventType

    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        out = run()
    del out

    def walk(events):
        for event in events:
            yield event
            yield from walk(event.children)

    allocations = [
        e for e in walk(prof.profiler.kineto_results.experimental_event_tree())
        if e.tag == _EventType.Allocation
    ]
    allocations.sort(key=lambda e: e.start_time_ns)
    live = peak = 0
    for event in allocations:
        live += event.extra_fields.alloc_size  # negative for frees
        peak = max(peak, live)
    return {"extra_bytes": peak, "method": "torch.profiler", "note": note}


def _child(target: str, kwargs: dict, method: str) -> dict:
    module_name, _, func_name = target.partition(":")
    run = getattr(importlib.import_module(module_name), func_name)(**kwargs)
    # Warm-up: thread pools, lazily built kernels and their buffers are not the call's cost.
    run()
    gc.collect()
    reason = "profiler forced" if method == "profiler" else None
    if method != "profiler":
        reason = _reset_peak_rss()
        if reason is None:
            return _measure_rss(run)
        if method == "rss":
            return {"extra_bytes": None, "method": "n/a", "note": reason}
    try:
        return _measure_profiler(run, note=reason or "")
    except Exception as exc:  # noqa: BLE001 - the fallback must never crash the benchmark
        return {"extra_bytes": None, "method": "n/a", "note": f"{reason}; profiler failed: {exc!r}"}


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Peak-memory probe child (internal).")
    parser.add_argument("target")
    parser.add_argument("kwargs")
    parser.add_argument("--method", choices=("auto", "rss", "profiler"), default="auto")
    args = parser.parse_args(argv)
    result = _child(args.target, json.loads(args.kwargs), args.method)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
