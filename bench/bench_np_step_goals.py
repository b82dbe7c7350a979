"""The ``np_step`` benchmark's goal and the time ratios it is judged on: shared by the measurements
(:mod:`bench.bench_np_step`) and the report (:mod:`bench.bench_np_step_report`). Every ratio is a time
ratio, ours over the other: below 1 = ours faster."""

from __future__ import annotations

#: The goal: the step's attention on attn_ext takes at most this fraction of SDPA's time on the same calls
#: (no slower than PyTorch's; the bound the call_overhead benchmark sets on single NP-shaped calls).
MAX_ATTENTION_RATIO = 1.0
GOAL_KEYS: tuple[str, ...] = ("tnpd", "lbanp", "cmanp")


def ratio(impls: dict | None, num: str, den: str) -> float | None:
    """``impls[num]``'s median over ``impls[den]``'s; None when either is missing or failed."""
    a, b = ((impls or {}).get(i, {}).get("median_ms") for i in (num, den))
    return a / b if a and b else None


def step_ratio(row: dict) -> float | None:
    """Ours' step time over the twin's (None without a twin)."""
    return ratio(row["impls"], "ours", "twin")


def attention_ratio(row: dict) -> float | None:
    """The step's attention on attn_ext over SDPA's on the same calls (None without softmax attention)."""
    return ratio(row.get("attention", {}).get("impls"), "ours", "sdpa")
