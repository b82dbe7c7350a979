"""Softmax attention held densely, differentiable to any order: the composite that more than one op
family differentiates (cross attention and σIntention's second stage).

It computes the ``[M, N]`` scores at once, as PyTorch's math path of SDPA does, and follows the library's
NaN rule: padded keys and their values are never read, a row without a valid key (or whose valid keys all
score -inf) gives ``out = 0, lse = -inf`` with zero derivatives, and NaN anywhere else reaches the rows
that read it. Every ``torch.where`` selects between two finite branches so that no NaN leaks into the
derivatives of empty rows.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from attn_ext.ops.utils.dtypes import accumulation_dtype


def dense_attention(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], scale: float
              ) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` of softmax attention, differentiable to any order, in the accumulation dtype."""
    acc = accumulation_dtype(q.dtype)
    qf, kf, vf = q.to(acc), k.to(acc), v.to(acc)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], -math.inf)
        vf = vf.masked_fill(key_padding_mask[:, None, :, None], 0.0)  # a padded value is never read
    # Empty: no valid key, or every valid key scores -inf (weight 0 each, as in the kernels). NaN is not empty.
    empty = torch.isneginf(torch.logsumexp(scores.detach(), dim=-1))
    safe_scores = torch.where(empty[..., None], torch.zeros_like(scores), scores)
    safe_lse = torch.logsumexp(safe_scores, dim=-1)
    probs = torch.where(empty[..., None], torch.zeros_like(scores), torch.exp(safe_scores - safe_lse[..., None]))
    lse = torch.where(empty, torch.full_like(safe_lse, -math.inf), safe_lse)
    return torch.matmul(probs, vf), lse
