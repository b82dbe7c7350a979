"""What turns the scaled dot products of an attention call into scores besides the mask: a soft cap
``s = c · tanh(s / c)`` (Gemma 2, Grok: ``softcap``) and ALiBi's linear bias ``−slope_h · |i' − j|``
(``alibi_slopes``, one slope per query head, ``i' = i + diagonal`` the query's diagonal key), as the ops take
them (the kernels' ``cap_scores`` and ``add_alibi`` of ``csrc/cpu/attention_masking.h``). The order is the
kernels': the cap first, then the float mask and ALiBi are added, then the masked pairs are set to ``-inf``.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["ScoreMod", "check_score_mod_args"]


class ScoreMod(NamedTuple):
    softcap: float = 0.0
    alibi_slopes: Optional[Tensor] = None  # fp32 [B, Hq]
    diagonal: int = 0

    @property
    def active(self) -> bool:
        return self.softcap > 0 or self.alibi_slopes is not None

    def cap(self, scores: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        """``(c · tanh(s / c), tanh(s / c))``, or ``(scores, None)`` without a cap."""
        if not self.softcap > 0:
            return scores, None
        t = torch.tanh(scores / self.softcap)
        return self.softcap * t, t

    def alibi(self, queries: int, n0: int, n1: int, dtype: torch.dtype, device) -> Optional[Tensor]:
        """``[B, Hq, queries, n1 − n0]``: ``−slope · |m + diagonal − n|`` of the keys ``[n0, n1)``, or None."""
        if self.alibi_slopes is None:
            return None
        distance = (torch.arange(queries, device=device).view(queries, 1) + self.diagonal
                    - torch.arange(n0, n1, device=device).view(1, n1 - n0)).abs().to(dtype)
        return -self.alibi_slopes.to(dtype)[:, :, None, None] * distance


def check_score_mod_args(softcap: float, alibi_slopes: Optional[Tensor], batch: int, heads: int, device) -> None:
    """The ops' checks of ``softcap`` (0: none, else finite > 0) and ``alibi_slopes`` (fp32 ``[B, Hq]``)."""
    if not (softcap == 0 or (math.isfinite(softcap) and softcap > 0)):
        raise ValueError(f"attn_ext.scaled_dot_product_attention: softcap must be a finite float > 0 (or 0: none), "
                         f"got {softcap}")
    if alibi_slopes is None:
        return
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"attn_ext.scaled_dot_product_attention: alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) != (batch, heads):
        raise ValueError(f"attn_ext.scaled_dot_product_attention: alibi_slopes must be [B, Hq] = [{batch}, {heads}], "
                         f"got {list(alibi_slopes.shape)}")
    if alibi_slopes.device != device:
        raise ValueError(f"attn_ext.scaled_dot_product_attention: alibi_slopes is on {alibi_slopes.device} but q is "
                         f"on {device}")
