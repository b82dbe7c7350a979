"""The ``sdpa`` benchmark's goals and the names of its implementations: what the measurements
(:mod:`bench.bench_sdpa`) are judged against and what the report (:mod:`bench.bench_sdpa_report`) prints,
shared by both."""

from __future__ import annotations

#: Goals: ours / SDPA at most MAX_SDPA_RATIO (causal and masked); ours causal / ours non-causal at most
#: MAX_CAUSAL_RATIO at L = CAUSAL_GOAL_L (at small L fixed costs keep the ratio nearer 1).
MAX_SDPA_RATIO = 1.0
MAX_CAUSAL_RATIO = 0.6
CAUSAL_GOAL_L = 16384

LABELS = {"ours_causal": "ours causal", "sdpa_causal": "SDPA causal", "ours_full": "ours non-causal",
          "sdpa_full": "SDPA non-causal", "ours_mask": "ours mask", "sdpa_mask": "SDPA mask",
          "ours_causal_kpm": "ours is_causal + key_padding_mask"}

#: Goal name -> (section, numerator, denominator, limit).
GOALS = {"causal_vs_sdpa": ("causal", "ours_causal", "sdpa_causal", MAX_SDPA_RATIO),
         "causal_vs_noncausal": ("causal", "ours_causal", "ours_full", MAX_CAUSAL_RATIO),
         "mask_vs_sdpa": ("mask", "ours_mask", "sdpa_mask", MAX_SDPA_RATIO)}


def ratio(row: dict, a: str, b: str) -> float | None:
    """``a``'s median time over ``b``'s in ``row``; None when either is missing."""
    ta, tb = (row["impls"].get(i, {}).get("median_ms") for i in (a, b))
    return ta / tb if ta and tb else None
