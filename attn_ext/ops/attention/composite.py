"""Differentiable PyTorch compositions of the attention ops, for derivatives beyond the first order.

The fused kernels give first derivatives; second derivatives (``create_graph=True``), forward-mode
tangents and ``torch.func`` transforms differentiate these functions instead (see
:mod:`attn_ext.ops.utils.autograd`). They compute the same math densely — the ``[L, S]`` scores are
held, as in PyTorch's own math path of SDPA. ``cross_attention`` differentiates
:func:`~attn_ext.ops.utils.dense_attention.dense_attention` (its NaN rule is stated there).

For ``attention_fwd`` values are exactly the reference's (:mod:`.naive`), NaN rule included.
Derivatives are those of the same math on the finite parts of q, k, v: pairs that take no part
contribute exactly 0 (a where on finite operands, so no ``0 · NaN`` reaches them), and where an output
entry is non-finite its derivative is 0 rather than NaN (the first-order kernels give NaN there).
"""
from __future__ import annotations

import math
from typing import Sequence, Tuple

import torch
from torch import Tensor

from attn_ext.ops.attention import naive
from attn_ext.ops.attention.dropout import keep_mask
from attn_ext.ops.attention.band import Band
from attn_ext.ops.attention.packed import packed_composite
from attn_ext.ops.attention.pairs import chunk_rules, expand_heads
from attn_ext.ops.attention.score_mod import ScoreMod
from attn_ext.ops.utils.dense_attention import dense_attention
from attn_ext.ops.utils.dtypes import accumulation_dtype


def cross_attention(inputs: Sequence, outputs: Sequence[Tensor]) -> Tuple[Tensor, Tensor]:
    """The composite of ``cross_attention_fwd(q, k, v, key_padding_mask, scale, chunk_size)``."""
    q, k, v, key_padding_mask, scale, _chunk_size = inputs
    out, lse = dense_attention(q, k, v, key_padding_mask, scale)
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


# ---- attention_fwd: attention mask, causal order, dropout, grouped heads

def _finite(x: Tensor) -> Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def attention(inputs: Sequence, outputs: Sequence[Tensor]) -> Tuple[Tensor, Tensor]:
    """The composite of ``attention_fwd(q, k, v, attn_mask, key_padding_mask, scale, is_causal, dropout_p,
    dropout_seed, chunk_size[, window_left, window_right, diagonal, softcap, alibi_slopes, cu_seqlens_q,
    cu_seqlens_k, bottom_right])``: ``(out, lse)``."""
    if len(inputs) > 15 and inputs[15] is not None:  # a packed (varlen) batch: each sequence's own composite
        return packed_composite(attention, inputs, outputs)
    q, k, v, attn_mask, key_padding_mask, scale, is_causal, dropout_p, dropout_seed, _chunk = inputs[:10]
    window_left, window_right, diagonal, softcap, alibi_slopes = (tuple(inputs[10:15]) + (-1, -1, 0, 0.0, None)[
        len(inputs[10:15]):])
    band = Band.of(is_causal, window_left, window_right, diagonal)
    mod = ScoreMod(softcap, alibi_slopes, diagonal)
    acc = accumulation_dtype(q.dtype)
    B, Hq, L, _ = q.shape
    S = k.shape[2]
    qf, kf, vf = _finite(q.to(acc)), _finite(expand_heads(k, Hq).to(acc)), _finite(expand_heads(v, Hq).to(acc))
    allowed, bias = chunk_rules(attn_mask, key_padding_mask, band, 0, S, L, acc, q.device)
    scores, _ = mod.cap(torch.matmul(qf, kf.transpose(-1, -2)) * scale)
    if bias is not None:
        scores = scores + torch.where(torch.isneginf(bias), torch.zeros_like(bias), bias)
    if mod.alibi_slopes is not None:
        scores = scores + mod.alibi(L, 0, S, acc, q.device)
    if allowed is not None:
        scores = torch.where(allowed, scores, torch.full_like(scores, -math.inf))
    empty = torch.isneginf(torch.logsumexp(scores.detach(), dim=-1)) if S > 0 else \
        torch.ones((B, Hq, L), dtype=torch.bool, device=q.device)
    safe_scores = torch.where(empty[..., None], torch.zeros_like(scores), scores)
    safe_lse = torch.logsumexp(safe_scores, dim=-1) if S > 0 else torch.zeros((B, Hq, L), dtype=acc, device=q.device)
    probs = torch.where(empty[..., None], torch.zeros_like(scores), torch.exp(safe_scores - safe_lse[..., None]))
    if dropout_p > 0.0:
        keep = keep_mask(dropout_seed, dropout_p, (B, Hq, L, S), device=q.device)
        probs = probs * keep.to(acc) / (1.0 - dropout_p)
    out = torch.matmul(probs, vf)
    lse = torch.where(empty, torch.full_like(safe_lse, -math.inf), safe_lse)
    with torch.no_grad():  # the exact values, NaN rule included
        out_exact, lse_exact = naive.attention_forward(*[x.detach() if isinstance(x, Tensor) else x for x in inputs])
    out = torch.where(torch.isfinite(out_exact), out, out_exact.to(acc))
    lse = torch.where(torch.isfinite(lse_exact) | torch.isneginf(lse_exact), lse, lse_exact)
    return out.to(q.dtype), lse
