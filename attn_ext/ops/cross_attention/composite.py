"""Differentiable PyTorch compositions of the cross-attention ops, for derivatives beyond the first order.

The fused kernels give first derivatives; second derivatives (``create_graph=True``), forward-mode
tangents and ``torch.func`` transforms differentiate these functions instead (see
:mod:`attn_ext.ops.utils.autograd`). They compute the same math densely — the ``[M, N]`` scores are
held, as in PyTorch's own math path of SDPA — and follow the library's NaN rule: padded keys and their
values are never read, a row without a valid key (or whose valid keys all score -inf) gives
``out = 0, lse = -inf`` with zero derivatives, and NaN anywhere else reaches the rows that read it. Every ``torch.where`` selects between two finite branches so
that no NaN leaks into the derivatives of empty rows.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from attn_ext.ops.utils.dtypes import accumulation_dtype


def attention(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], scale: float
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


def cross_attention(inputs: Sequence, outputs: Sequence[Tensor]) -> Tuple[Tensor, Tensor]:
    """The composite of ``cross_attention_fwd(q, k, v, key_padding_mask, scale, chunk_size)``."""
    q, k, v, key_padding_mask, scale, _chunk_size = inputs
    out, lse = attention(q, k, v, key_padding_mask, scale)
    return out.to(q.dtype), lse


def merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tuple[Tensor, Tensor]:
    """The state of the union of two disjoint key sets; an empty side (lse = -inf) weighs 0."""
    empty = torch.isneginf(lse_a) & torch.isneginf(lse_b)
    zero = torch.zeros_like(lse_a)
    top = torch.where(empty, zero, torch.maximum(lse_a, lse_b))
    # exp(-inf - top) = 0 for one empty side; both empty: finite 0 - 0 here, masked below.
    weight_a = torch.exp(torch.where(empty, zero, lse_a) - top)
    weight_b = torch.exp(torch.where(empty, zero, lse_b) - top)
    total = weight_a + weight_b
    lse = torch.where(empty, torch.full_like(lse_a, -math.inf), top + torch.log(total))
    weight_a = torch.where(empty, zero, weight_a / total)
    weight_b = torch.where(empty, zero, weight_b / total)
    acc = lse_a.dtype
    out = weight_a[..., None] * out_a.to(acc) + weight_b[..., None] * out_b.to(acc)
    return out.to(out_a.dtype), lse


def merge_states(inputs: Sequence, outputs: Sequence[Tensor]) -> Tuple[Tensor, Tensor]:
    """The composite of ``merge_states_fwd(out_a, lse_a, out_b, lse_b)``."""
    return merge(*inputs)
