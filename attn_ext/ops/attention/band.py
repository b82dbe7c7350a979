"""The band of keys each query may attend by position: the causal rule and a sliding window about the query's
diagonal key, as the ops take them (``is_causal``, ``window_left``, ``window_right``, ``diagonal``; the kernels'
``Band`` of ``csrc/cpu/attention_masking.h``).

Query ``m``'s diagonal key is ``m + diagonal`` (0 with the queries at the start of the keys, ``S − L`` with them
at the end). Key ``n`` takes part only if ``m + lo ≤ n ≤ m + hi``: the causal rule sets ``hi = diagonal``, a window
``(left, right)`` ``lo = diagonal − left`` and ``hi = diagonal + right`` (the smaller with the causal rule); a side
set to ``-1`` (or left out) has no limit.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["Band", "check_band_args"]


class Band(NamedTuple):
    """Keys ``m + lo ≤ n ≤ m + hi`` of query ``m``; None: no limit on that side."""
    lo: Optional[int] = None
    hi: Optional[int] = None

    @staticmethod
    def of(is_causal: bool, window_left: int = -1, window_right: int = -1, diagonal: int = 0) -> "Band":
        lo = diagonal - window_left if window_left >= 0 else None
        hi = diagonal if is_causal else None
        if window_right >= 0:
            hi = diagonal + window_right if hi is None else min(hi, diagonal + window_right)
        return Band(lo, hi)

    @property
    def active(self) -> bool:
        return self.lo is not None or self.hi is not None

    def allowed(self, queries: int, n0: int, n1: int, device) -> Optional[Tensor]:
        """``[queries, n1 − n0]`` bool: which pairs of the keys ``[n0, n1)`` the band lets take part (None: all)."""
        if not self.active:
            return None
        offset = torch.arange(n0, n1, device=device).view(1, n1 - n0) - torch.arange(queries, device=device).view(
            queries, 1)  # n − m
        ok = torch.ones((queries, n1 - n0), dtype=torch.bool, device=device)
        if self.lo is not None:
            ok = ok & (offset >= self.lo)
        if self.hi is not None:
            ok = ok & (offset <= self.hi)
        return ok

    def keys(self, queries: int, keys: int) -> Tuple[int, int]:
        """``[first, end)``: the keys some query of ``queries`` may attend, within ``[0, keys)``."""
        first = 0 if self.lo is None else min(max(self.lo, 0), keys)
        end = keys if self.hi is None else min(max(queries - 1 + self.hi + 1, first), keys)
        return first, end


def check_band_args(window_left: int, window_right: int, diagonal: int) -> None:
    """The band arguments of the attention ops (the C++ ops' ``check_attention_band``): each window side ``-1``
    or a key count ``>= 0``, the diagonal offset below ``2**61`` in magnitude."""
    if not (window_left >= -1 and window_right >= -1):
        raise ValueError(f"attn_ext.scaled_dot_product_attention: window_size = ({window_left}, {window_right}) must "
                         "be keys before and after the diagonal, >= 0, or -1 for no limit on that side")
    if abs(diagonal) >= 2 ** 61:
        raise ValueError(f"attn_ext.scaled_dot_product_attention: diagonal offset {diagonal} is out of range")
