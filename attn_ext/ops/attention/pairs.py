"""Which (query, key) pairs take part in a masked attention call, and products that never read the rest.

A pair takes part (is *allowed*) iff every rule allows it: the bool ``attn_mask`` is True there, the
additive ``attn_mask`` is not −inf there, the key is not padding, and the key lies in the query's band
(:class:`~attn_ext.ops.attention.band.Band`: the causal rule, a sliding window). A pair that is not allowed is **never read**: NaN or inf in its key's ``k``
or ``v`` row, or in its query row, reaches neither that pair's output nor any gradient through it.
The GEMMs of a chunk would break that rule only through ``0 · NaN``, so :func:`weighted_rows` and
:func:`weighted_columns` switch to an exact per-pair product when the operand holds a non-finite value
— the same test the compiled kernels make per tile.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from attn_ext.ops.attention.band import Band
from attn_ext.ops.attention.score_mod import ScoreMod


def chunk_rules(attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], band: Band, n0: int, n1: int,
                queries: int, acc: torch.dtype, device) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """``(allowed, bias)`` of the keys ``[n0, n1)``: a bool tensor broadcastable to ``[B, Hq, L, n1 − n0]``
    (None: every pair takes part) and the additive float mask of the chunk in ``acc`` (None: none)."""
    allowed: Optional[Tensor] = None
    bias: Optional[Tensor] = None

    def both(a: Optional[Tensor], b: Tensor) -> Tensor:
        return b if a is None else a & b

    if attn_mask is not None:
        chunk = attn_mask[..., n0:n1]
        if chunk.dtype == torch.bool:
            allowed = chunk
        else:
            bias = chunk.to(acc)
            allowed = bias != -math.inf
    if key_padding_mask is not None:
        allowed = both(allowed, ~key_padding_mask[:, None, None, n0:n1])
    if band.active:  # the causal rule, a sliding window
        allowed = both(allowed, band.allowed(queries, n0, n1, device))
    return allowed, bias


def masked_scores(q: Tensor, k_chunk: Tensor, scale: float, allowed: Optional[Tensor], bias: Optional[Tensor],
                  mod: Optional[ScoreMod] = None, n0: int = 0) -> Tensor:
    """``scale · q kᵀ`` (soft-capped by ``mod``) ``+ bias`` (+ ALiBi of ``mod``, keys from ``n0``) on allowed pairs,
    −inf elsewhere (whatever ``q kᵀ`` holds there)."""
    return masked_scores_and_tanh(q, k_chunk, scale, allowed, bias, mod, n0)[0]


def masked_scores_and_tanh(q: Tensor, k_chunk: Tensor, scale: float, allowed: Optional[Tensor],
                           bias: Optional[Tensor], mod: Optional[ScoreMod] = None,
                           n0: int = 0) -> Tuple[Tensor, Optional[Tensor]]:
    """:func:`masked_scores` and the soft cap's ``tanh(s / c)`` (None without one): the backward's factor
    ``1 − tanh²``."""
    scores = torch.matmul(q, k_chunk.transpose(-1, -2)) * scale
    tanh = None
    if mod is not None and mod.active:
        scores, tanh = mod.cap(scores)
    if bias is not None:
        scores = scores + bias
    if mod is not None and mod.alibi_slopes is not None:
        scores = scores + mod.alibi(q.shape[-2], n0, n0 + k_chunk.shape[-2], scores.dtype, scores.device)
    if allowed is not None:
        scores = torch.where(allowed, scores, torch.full_like(scores, -math.inf))
    return scores, tanh


def _known_finite(x: Tensor) -> bool:
    """Whether ``x`` holds only finite values; False where that cannot be asked (``torch.func.vmap`` has
    no data-dependent branches), where the exact per-pair product, right either way, is taken."""
    try:
        return bool(torch.isfinite(x).all())
    except RuntimeError:
        return False


def weighted_rows(weights: Tensor, allowed: Optional[Tensor], x: Tensor) -> Tensor:
    """``Σ_n weights[m, n] · x[n]`` over allowed pairs: ``[..., L, n] × [..., n, d] -> [..., L, d]``."""
    if allowed is None or _known_finite(x):
        return torch.matmul(weights, x)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    return (weights[..., None] * torch.where(allowed[..., None], x[..., None, :, :], zero)).sum(dim=-2)


def weighted_columns(weights: Tensor, allowed: Optional[Tensor], y: Tensor) -> Tensor:
    """``Σ_m weights[m, n] · y[m]`` over allowed pairs: ``[..., L, n] × [..., L, d] -> [..., n, d]``."""
    if allowed is None or _known_finite(y):
        return torch.matmul(weights.transpose(-1, -2), y)
    zero = torch.zeros((), dtype=y.dtype, device=y.device)
    return (weights[..., None] * torch.where(allowed[..., None], y[..., :, None, :], zero)).sum(dim=-3)


def zero_outside(x: Tensor, allowed: Optional[Tensor]) -> Tensor:
    """``x`` with the pairs that do not take part set to exactly 0 (NaN there included)."""
    return x if allowed is None else torch.where(allowed, x, torch.zeros_like(x))


def expand_heads(x: Tensor, query_heads: int) -> Tensor:
    """``[B, Hkv, S, d]`` as ``[B, Hq, S, d]``: query head h reads key/value head ``h // (Hq // Hkv)``."""
    if x.shape[1] == query_heads:  # also Hq = Hkv = 0, which has no group
        return x
    return x.repeat_interleave(query_heads // x.shape[1], dim=1)


def sum_heads(grad: Tensor, kv_heads: int) -> Tensor:
    """The gradient of :func:`expand_heads`: ``[B, Hq, S, d]`` summed over each group to ``[B, Hkv, S, d]``."""
    B, Hq, S, d = grad.shape
    return grad if Hq == kv_heads else grad.view(B, kv_heads, Hq // kv_heads, S, d).sum(dim=2)
