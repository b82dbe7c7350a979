"""Pure-PyTorch masked attention with dropout and grouped heads: what every kernel of ``attention_fwd`` /
``attention_bwd`` computes, chunk by chunk over the keys (docs/sdpa.md).

The same online-softmax forward and FlashAttention backward as the unmasked reference
(:mod:`attn_ext.ops.cross_attention.naive`), with the pair rules of :mod:`.pairs` (attention mask,
key padding, causal order), the counter-based dropout of :mod:`.dropout`, and query heads sharing
key/value heads (GQA). Accumulates in fp32 (fp64 for fp64 inputs); the reference backend and the tests'
ground truth.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from attn_ext.ops.cross_attention.naive import PRECISE_NORMALISER_LSE, finish_rows
from attn_ext.ops.sdpa.dropout import keep_mask
from attn_ext.ops.sdpa.pairs import (chunk_rules, expand_heads, masked_scores, sum_heads, weighted_columns,
                                     weighted_rows, zero_outside)
from attn_ext.ops.utils.dtypes import accumulation_dtype


def _key_chunks(S: int, L: int, chunk_size: int, is_causal: bool):
    """Key ranges ``[n0, n1)`` that some query may attend: causal calls stop at key L − 1."""
    last = min(S, L) if is_causal else S
    for n0 in range(0, last, chunk_size):
        yield n0, min(last, n0 + chunk_size)


def _dropout_scale(seed: Optional[Tensor], dropout_p: float, shape, n0: int, n1: int, acc, device) -> Optional[Tensor]:
    """``keep / (1 − p)`` of the chunk's pairs, or None without dropout."""
    if dropout_p == 0.0:
        return None
    keep = keep_mask(seed, dropout_p, shape, n0, n1 - n0, device=device)
    return keep.to(acc) / (1.0 - dropout_p)


def attention_forward(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor],
                      scale: float, is_causal: bool, dropout_p: float, dropout_seed: Optional[Tensor],
                      chunk_size: int) -> Tuple[Tensor, Tensor]:
    """``(out [B, Hq, L, Dv], lse [B, Hq, L])``; a row with no pair taking part is ``(0, −inf)``."""
    acc = accumulation_dtype(q.dtype)
    B, Hq, L, _ = q.shape
    S, Dv = k.shape[2], v.shape[3]
    qf = q.to(acc)
    kx, vx = expand_heads(k, Hq), expand_heads(v, Hq)
    running_max = torch.full((B, Hq, L), -math.inf, dtype=acc, device=q.device)
    running_sum = torch.zeros((B, Hq, L), dtype=acc, device=q.device)
    out = torch.zeros((B, Hq, L, Dv), dtype=acc, device=q.device)
    for n0, n1 in _key_chunks(S, L, chunk_size, is_causal):
        allowed, bias = chunk_rules(attn_mask, key_padding_mask, is_causal, n0, n1, L, acc, q.device)
        scores = masked_scores(qf, kx[:, :, n0:n1].to(acc), scale, allowed, bias)
        new_max = torch.maximum(running_max, scores.amax(dim=-1))  # both propagate NaN
        shift = torch.where(new_max == -math.inf, torch.zeros_like(new_max), new_max)
        factor = torch.exp(running_max - shift)
        probs = torch.exp(scores - shift[..., None])
        running_sum = running_sum * factor + probs.sum(dim=-1)
        dropped = _dropout_scale(dropout_seed, dropout_p, (B, Hq, L, S), n0, n1, acc, q.device)
        weights = probs if dropped is None else probs * dropped
        out = out * factor[..., None] + weighted_rows(weights, allowed, vx[:, :, n0:n1].to(acc))
        running_max = new_max
    out, lse = finish_rows(out, running_max, running_sum)
    return out.to(q.dtype), lse


def row_normaliser(qf: Tensor, kx: Tensor, attn_mask, key_padding_mask, is_causal: bool, lse: Tensor, scale: float,
                chunk_size: int) -> Tuple[Tensor, Tensor]:
    """``(shift, log_sum)`` with ``P = exp((s − shift) − log_sum)``: the saved lse, except rows with
    |lse| ≥ 512, whose exact (max, log Σ) are recomputed (the fp32 lse has rounded log Σ away there)."""
    precise = torch.isfinite(lse) & (lse.abs() >= PRECISE_NORMALISER_LSE)
    if not bool(precise.any()):
        return lse[..., None], torch.zeros_like(lse)[..., None]
    L, S = qf.shape[2], kx.shape[2]
    row_max = torch.full_like(lse, -math.inf)
    total = torch.zeros_like(lse)
    for n0, n1 in _key_chunks(S, L, chunk_size, is_causal):
        allowed, bias = chunk_rules(attn_mask, key_padding_mask, is_causal, n0, n1, L, qf.dtype, qf.device)
        scores = masked_scores(qf, kx[:, :, n0:n1].to(qf.dtype), scale, allowed, bias)
        new_max = torch.maximum(row_max, scores.amax(dim=-1))
        safe = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
        total = total * torch.exp(row_max - safe) + torch.exp(scores - safe[..., None]).sum(dim=-1)
        row_max = new_max
    shift = torch.where(precise, row_max, lse)
    log_sum = torch.where(precise, torch.log(total), torch.zeros_like(lse))
    return shift[..., None], log_sum[..., None]


def attention_backward(grad_out: Tensor, grad_lse: Tensor, q: Tensor, k: Tensor, v: Tensor,
                       attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], out: Tensor, lse: Tensor,
                       scale: float, is_causal: bool, dropout_p: float, dropout_seed: Optional[Tensor],
                       chunk_size: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of q, k, v (FlashAttention's backward with the dropout mask regenerated):
    ``dV = (P∘Z)ᵀ dO``, ``dP = (dO Vᵀ)∘Z``, ``dS = P∘(dP − Δ + dlse)``, ``Δ = rowsum(dO∘out)``.
    Pairs that take no part, and empty rows, contribute exactly 0."""
    acc = accumulation_dtype(q.dtype)
    B, Hq, L, _ = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qf, dout = q.to(acc), grad_out.to(acc)
    lse = lse.to(acc)
    kx, vx = expand_heads(k, Hq), expand_heads(v, Hq)
    empty_row = (lse == -math.inf)[..., None]
    shift, log_sum = row_normaliser(qf, kx, attn_mask, key_padding_mask, is_causal, lse, scale, chunk_size)
    delta_minus_dlse = (dout * out.to(acc)).sum(dim=-1) - grad_lse.to(acc)
    grad_q = torch.zeros_like(qf, memory_format=torch.contiguous_format)  # as the fake kernel declares
    grad_k = torch.zeros((B, Hq) + tuple(k.shape[2:]), dtype=acc, device=q.device)
    grad_v = torch.zeros((B, Hq) + tuple(v.shape[2:]), dtype=acc, device=q.device)
    for n0, n1 in _key_chunks(S, L, chunk_size, is_causal):
        allowed, bias = chunk_rules(attn_mask, key_padding_mask, is_causal, n0, n1, L, acc, q.device)
        k_chunk, v_chunk = kx[:, :, n0:n1].to(acc), vx[:, :, n0:n1].to(acc)
        scores = masked_scores(qf, k_chunk, scale, allowed, bias)
        # Zero outside too: a NaN row's lse would make exp(−inf − NaN) = NaN on its masked pairs.
        probs = zero_outside(torch.where(empty_row, torch.zeros_like(scores), torch.exp((scores - shift) - log_sum)),
                             allowed)
        dropped = _dropout_scale(dropout_seed, dropout_p, (B, Hq, L, S), n0, n1, acc, q.device)
        kept = probs if dropped is None else probs * dropped
        grad_v[:, :, n0:n1] = weighted_columns(kept, allowed, dout)
        grad_probs = torch.matmul(dout, v_chunk.transpose(-1, -2))
        if dropped is not None:
            grad_probs = grad_probs * dropped
        grad_scores = zero_outside(probs * (grad_probs - delta_minus_dlse[..., None]), allowed)
        grad_q = grad_q + scale * weighted_rows(grad_scores, allowed, k_chunk)
        grad_k[:, :, n0:n1] = scale * weighted_columns(grad_scores, allowed, qf)
    return grad_q.to(q.dtype), sum_heads(grad_k, Hkv).to(k.dtype), sum_heads(grad_v, Hkv).to(v.dtype)
