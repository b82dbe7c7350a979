"""Judging a benchmark's goals: a goal reads "NOT met" only when a re-measurement agrees.

On a shared 2-core machine one burst of background load moves a timing by tens of percent. A timing
goal that fails, or passes within :data:`BORDERLINE` of its limit, is therefore measured again after
the machine has had a moment to settle (:func:`wait_for_quiet`); it is "NOT met" only when every
measurement fails it and the re-measurement ran on a quiet machine ("not confirmed" when the machine stayed
busy), and the report shows every value. Goals defined on the full grid say so when a
quick run judges them on fewer sizes, or does not judge them at all (:func:`grid_note`).
"""

from __future__ import annotations

import os
import time
from typing import Callable, Sequence

#: A value within this fraction of its limit (either side) is re-measured before it is judged.
BORDERLINE = 0.10
#: How long :func:`wait_for_quiet` waits at most for the load average to drop.
QUIET_WAIT_S = 10.0


def verdict(met: bool | None) -> str:
    """How a goal reads in a report."""
    return {True: "met", False: "NOT met", None: "not measured"}[met]


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def wait_for_quiet(max_wait_s: float | None = None, poll_s: float = 1.0) -> float | None:
    """Wait until the 1-min load average is below the CPU count (nothing else competing for a core), at
    most ``max_wait_s`` (default :data:`QUIET_WAIT_S`, which ``python -m bench run --quick`` lowers);
    returns the load average when the wait ended (None where unsupported)."""
    max_wait_s = QUIET_WAIT_S if max_wait_s is None else max_wait_s
    cpus = os.cpu_count() or 1
    deadline = time.monotonic() + max_wait_s
    load = load_average()
    while load is not None and load >= cpus and time.monotonic() < deadline:
        time.sleep(poll_s)
        load = load_average()
    return load


def confirm(first: float | None, limit: float, higher_is_better: bool,
            remeasure: Callable[[], float | None] | None, what: str, log: Callable[[str], None] | None = None,
            quiet: bool = True) -> dict:
    """Judge ``first`` against ``limit``; re-measure it once (``remeasure()``) if it fails or is borderline,
    after :func:`wait_for_quiet` (unless ``quiet`` is False: ``remeasure`` returns an earlier re-measurement).

    Returns
    -------
    dict
        ``{"values": [first, (re-measured)], "limit", "met", "remeasured", "load_at_remeasure", "verdict"}``;
        ``met`` is True when any measured value meets the limit, False only when every one fails and the
        re-measurement ran on a quiet machine (1-min load below the CPU count), None otherwise ("not
        measured", or "not confirmed" when both failed on a busy machine).
    """
    def ok(v: float) -> bool:
        return v >= limit if higher_is_better else v <= limit

    out = {"values": [first], "limit": limit, "met": None, "remeasured": False, "load_at_remeasure": None,
           "verdict": verdict(None)}
    if first is None:
        return out
    busy = False
    if remeasure is not None and (not ok(first) or abs(first / limit - 1) <= BORDERLINE):
        load = wait_for_quiet() if quiet else load_average()
        busy = load is not None and load >= (os.cpu_count() or 1)
        if log is not None:
            log(f"re-measuring {what}: {first:.3g} against the limit {limit:g}"
                + (f" (1-min load average {load:.2f})" if load is not None else "") + " ...")
        second = remeasure()
        out.update(values=[first, second], remeasured=True,
                   load_at_remeasure=None if load is None else round(load, 2))
        if log is not None:
            log(f"  re-measured {what}: {'n/a' if second is None else f'{second:.3g}'}")
    measured = [v for v in out["values"] if v is not None]
    if any(ok(v) for v in measured):
        out.update(met=True, verdict="met")
    elif busy:
        # Both measurements failed, but the second was not quiet either: no verdict either way.
        out.update(met=None, verdict="not confirmed")
    else:
        out.update(met=False, verdict="NOT met")
    return out


def confirmed_text(judged: dict, fmt: Callable[[float], str]) -> str:
    """The value(s) of a :func:`confirm` result and its verdict, e.g. ``"1.62x, re-measured 1.41x: **met**"``."""
    values = judged["values"]
    text = "n/a" if values[0] is None else fmt(values[0])
    if judged["remeasured"]:
        text += ", re-measured " + ("n/a" if values[1] is None else fmt(values[1]))
    if judged["verdict"] == "not confirmed":
        return f"{text}, **not confirmed** (failed twice; the machine was busy, 1-min load {judged['load_at_remeasure']})"
    return f"{text}, **{judged['verdict']}**"


def combined(judged: Sequence[dict]) -> tuple[bool | None, str]:
    """``(met, verdict)`` of a goal made of several :func:`confirm` results (rows, branchings): NOT met if
    any is, else not confirmed if any is, else met if any was measured."""
    verdicts = {j["verdict"] for j in judged}
    for met, text in ((False, "NOT met"), (None, "not confirmed"), (True, "met")):
        if text in verdicts:
            return met, text
    return None, "not measured"


def grid_note(quick: bool, defined_on: str, judged_on: str | None) -> str:
    """What a quick run says after a goal defined on the full grid (empty for a full run).

    ``judged_on`` None: the quick grid lacks the sizes the goal is defined at, so it is not judged; equal
    to ``defined_on``: the quick grid has the goal's sizes, nothing to say.
    """
    if not quick or judged_on == defined_on:
        return ""
    if judged_on is None:
        return f" (not judged on the quick grid: the goal is defined on the full grid's {defined_on})"
    return f" (judged on the quick grid's {judged_on}; the goal is defined on the full grid's {defined_on})"


def sizes(ns: Sequence[int]) -> str:
    """``N = 1,000, 10,000`` for a goal's grid note."""
    return "N = " + ", ".join(f"{n:,}" for n in ns)


def max_step(values: Sequence[float | None]) -> tuple[float | None, int | None]:
    """The largest ratio of a value to the one before it, and the index of that step's first value;
    ``(None, None)`` with fewer than two values or any missing."""
    if len(values) < 2 or any(not v for v in values):
        return None, None
    at = max(range(len(values) - 1), key=lambda i: values[i + 1] / values[i])
    return values[at + 1] / values[at], at
