"""The GPU benchmarks' check before timing: a call's result must match a reference, or it is not timed.

A wrong kernel's speed means nothing, so every benchmark section compares the result of the call it is
about to time with a reference (SDPA, or attn_ext's fp64 ``reference`` backend) and raises
:class:`WrongResult` when the relative error is above the section's bound or a value is not finite.
"""
from __future__ import annotations

from typing import Mapping

import torch


class WrongResult(AssertionError):
    """A benchmarked call disagrees with its reference: its speed would mean nothing."""


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖ours − ref‖ / ‖ref‖`` (Frobenius, in fp64); inf when ``ours`` has a non-finite entry where ``ref``
    is finite, or differs from it where ``ref`` is not (the lse of an empty row is −inf)."""
    ours, ref = ours.double(), ref.double()
    if ours.shape != ref.shape:
        return float("inf")
    finite = torch.isfinite(ref)
    if not torch.equal(ours[~finite], ref[~finite]) or not bool(torch.isfinite(ours[finite]).all()):
        return float("inf")
    diff, ref = (ours - ref)[finite], ref[finite]
    return float(diff.norm() / ref.norm().clamp_min(1e-300)) if ref.numel() else 0.0


def require_close(label: str, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]], bound: float) -> float:
    """The largest relative error over ``{name: (ours, reference)}``; raises :class:`WrongResult` above
    ``bound``, naming every error."""
    errors = {name: relative_error(ours, ref) for name, (ours, ref) in pairs.items()}
    worst = max(errors.values())
    if not worst <= bound:
        raise WrongResult(f"{label}: relative error " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
                          + f" exceeds {bound:.0e}")
    return worst
