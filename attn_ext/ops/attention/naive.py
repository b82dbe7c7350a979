"""Pure-PyTorch attention: the readable statement of what every kernel of the family computes.

It follows docs/spec.md §1 step by step — the online-softmax forward over key chunks and the
FlashAttention backward from the saved log-sum-exp — in fp32 (fp64 for fp64 inputs), so it is
also the backend of last resort on any device and the fp64 ground truth that tests compare with.

* :func:`attention_forward` / :func:`attention_backward`: the general op ``attention_fwd`` (what
  ``scaled_dot_product_attention`` runs), with the pair rules of :mod:`.pairs` (attention mask, key
  padding, causal order), the counter-based dropout of :mod:`.dropout` and query heads sharing
  key/value heads (GQA);
* :func:`cross_attention_forward` / :func:`cross_attention_backward`: its special case with key padding
  as the only rule (``cross_attention_fwd``);
* :func:`merge_states_forward` / :func:`merge_states_backward`: the state of a union of key sets.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from attn_ext.ops.attention.dropout import keep_mask
from attn_ext.ops.attention.band import Band
from attn_ext.ops.attention.pairs import (chunk_rules, expand_heads, masked_scores, masked_scores_and_tanh,
                                          sum_heads, weighted_columns, weighted_rows, zero_outside)
from attn_ext.ops.attention.score_mod import ScoreMod
from attn_ext.ops.utils.dtypes import accumulation_dtype


def _chunk_scores(q: Tensor, k_chunk: Tensor, padding_chunk: Optional[Tensor], scale: float) -> Tensor:
    scores = torch.matmul(q, k_chunk.transpose(-1, -2)) * scale
    if padding_chunk is not None:
        scores = scores.masked_fill(padding_chunk[:, None, None, :], -math.inf)
    return scores


def _unpadded_rows(x: Tensor, padding_chunk: Optional[Tensor]) -> Tensor:
    """``x [B, H, n, d]`` with the padded keys' rows zeroed: padded keys are never read, and their
    probability 0 times a NaN value would otherwise make every query row NaN."""
    return x if padding_chunk is None else x.masked_fill(padding_chunk[:, None, :, None], 0)


def cross_attention_forward(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], scale: float, chunk_size: int
) -> Tuple[Tensor, Tensor]:
    """Exact attention over the keys, ``chunk_size`` keys at a time; returns ``(out, lse)``.

    NaN follows IEEE arithmetic of softmax (docs/cross_attention.md, "NaN, inf and empty rows"): the
    maxima propagate NaN, and NaN never becomes the empty row ``(0, −inf)``.
    """
    acc = accumulation_dtype(q.dtype)
    B, H, M, _ = q.shape
    N, Dv = k.shape[2], v.shape[3]
    qf = q.to(acc)
    running_max = torch.full((B, H, M), -math.inf, dtype=acc, device=q.device)
    running_sum = torch.zeros((B, H, M), dtype=acc, device=q.device)
    out = torch.zeros((B, H, M, Dv), dtype=acc, device=q.device)
    for n0 in range(0, N, chunk_size):
        padding = None if key_padding_mask is None else key_padding_mask[:, n0 : n0 + chunk_size]
        scores = _chunk_scores(qf, k[:, :, n0 : n0 + chunk_size].to(acc), padding, scale)
        v_chunk = _unpadded_rows(v[:, :, n0 : n0 + chunk_size].to(acc), padding)
        new_max = torch.maximum(running_max, scores.amax(dim=-1))  # both propagate NaN
        # A row with no valid key yet shifts by 0, so exp(−inf − 0) = 0 rather than exp(−inf + inf) = NaN.
        # Only −inf is guarded: a +inf maximum gives exp(inf − inf) = NaN, as softmax does.
        shift = torch.where(new_max == -math.inf, torch.zeros_like(new_max), new_max)
        factor = torch.exp(running_max - shift)
        probs = torch.exp(scores - shift[..., None])
        running_sum = running_sum * factor + probs.sum(dim=-1)
        out = out * factor[..., None] + torch.matmul(probs, v_chunk)
        running_max = new_max
    out, lse = finish_rows(out, running_max, running_sum)
    return out.to(q.dtype), lse


def finish_rows(out: Tensor, running_max: Tensor, running_sum: Tensor) -> Tuple[Tensor, Tensor]:
    """``(out / sum, max + log sum)`` of the online softmax's rows. No key with weight (all padded, none,
    or every score −inf: exp(−inf) = 0 as for padding) is the empty state (0, −inf); a NaN sum (a NaN
    score, +inf − +inf) is NaN, never empty."""
    empty = running_sum == 0
    positive = running_sum > 0
    safe_sum = torch.where(positive, running_sum, torch.ones_like(running_sum))
    nan = torch.full_like(running_sum, math.nan)
    lse = torch.where(positive, running_max + torch.log(safe_sum), nan)
    lse = torch.where(empty, torch.full_like(lse, -math.inf), lse)
    out = torch.where(positive[..., None], out / safe_sum[..., None], nan[..., None])
    return torch.where(empty[..., None], torch.zeros_like(out), out), lse


def cross_attention_backward(
    grad_out: Tensor,
    grad_lse: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Optional[Tensor],
    out: Tensor,
    lse: Tensor,
    scale: float,
    chunk_size: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of q, k, v from those of ``out`` and ``lse`` (docs/spec.md §1 backward), chunk by chunk.

    A NaN row (NaN ``out`` or ``lse``) gets NaN gradients and passes them to the keys it attends to;
    empty rows and padded keys get exactly zero.
    """
    acc = accumulation_dtype(q.dtype)
    qf, dout = q.to(acc), grad_out.to(acc)
    lse = lse.to(acc)
    empty_row = (lse == -math.inf)[..., None]  # the forward's marker of a row without any valid key
    shift, log_sum = _normaliser(qf, k, key_padding_mask, lse, scale, chunk_size)
    delta_minus_dlse = (dout * out.to(acc)).sum(dim=-1) - grad_lse.to(acc)
    grad_q = qf.new_zeros(qf.shape)  # contiguous, as the fake kernel declares
    grad_k_chunks, grad_v_chunks = [], []
    for n0 in range(0, k.shape[2], chunk_size):
        padding = None if key_padding_mask is None else key_padding_mask[:, n0 : n0 + chunk_size]
        k_chunk = _unpadded_rows(k[:, :, n0 : n0 + chunk_size].to(acc), padding)
        v_chunk = _unpadded_rows(v[:, :, n0 : n0 + chunk_size].to(acc), padding)
        scores = _chunk_scores(qf, k_chunk, padding, scale)
        probs = torch.where(empty_row, torch.zeros_like(scores), torch.exp((scores - shift) - log_sum))
        grad_probs = torch.matmul(dout, v_chunk.transpose(-1, -2))
        grad_scores = probs * (grad_probs - delta_minus_dlse[..., None])
        grad_q = grad_q + scale * torch.matmul(grad_scores, k_chunk)
        # A NaN row puts 0 · NaN = NaN on the padded keys too; they take no part, so their gradients are 0.
        grad_k_chunks.append(_unpadded_rows(scale * torch.matmul(grad_scores.transpose(-1, -2), qf), padding))
        grad_v_chunks.append(_unpadded_rows(torch.matmul(probs.transpose(-1, -2), dout), padding))
    grad_k = torch.cat(grad_k_chunks, dim=2) if grad_k_chunks else k.new_zeros(k.shape, dtype=acc)
    grad_v = torch.cat(grad_v_chunks, dim=2) if grad_v_chunks else v.new_zeros(v.shape, dtype=acc)
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


# From |lse| = 512 on, the fp32 lse = max + log(sum) has rounded log(sum) (<= log N) away by up to 2⁻¹⁵ of
# it: tied keys of a saturated softmax would each get P = 1. Such rows get their exact (max, log sum)
# again, as the cpp backward does; ordinary rows use the saved lse.
PRECISE_NORMALISER_LSE = 512.0


def _normaliser(qf: Tensor, k: Tensor, key_padding_mask: Optional[Tensor], lse: Tensor, scale: float,
                chunk_size: int) -> Tuple[Tensor, Tensor]:
    """``(shift [..., 1], log_sum [..., 1])`` with ``P = exp((s − shift) − log_sum)`` for every row: the
    masked reference's, with key padding as the only rule."""
    return row_normaliser(qf, k, None, key_padding_mask, Band(), lse, scale, chunk_size)


def _merge_weights(lse_a: Tensor, lse_b: Tensor, lse: Tensor) -> Tuple[Tensor, Tensor]:
    # Only −inf marks an empty merged row; NaN (a NaN side) gives NaN weights, hence a NaN merge.
    empty = lse == -math.inf
    zero = torch.zeros_like(lse)
    weight_a = torch.where(empty, zero, torch.exp(lse_a - torch.where(empty, zero, lse)))
    weight_b = torch.where(empty, zero, torch.exp(lse_b - torch.where(empty, zero, lse)))
    return weight_a, weight_b


def merge_states_forward(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tuple[Tensor, Tensor]:
    """State of the union of two disjoint key sets (docs/spec.md §1 merge).

    Merging with the empty state (0, −inf) returns the other state; a NaN on either side (lse or out)
    gives NaN, by IEEE arithmetic (logaddexp and the weights propagate it, and 0 · NaN = NaN).
    """
    acc = lse_a.dtype
    lse = torch.logaddexp(lse_a, lse_b)  # logaddexp(−inf, −inf) = −inf
    weight_a, weight_b = _merge_weights(lse_a, lse_b, lse)
    out = weight_a[..., None] * out_a.to(acc) + weight_b[..., None] * out_b.to(acc)
    return out.to(out_a.dtype).contiguous(), lse.contiguous()  # every backend returns contiguous states


def merge_states_backward(
    grad_out: Tensor, grad_lse: Tensor, out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, out: Tensor,
    lse: Tensor,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of both states: ``d out_x = w_x·g``, ``d lse_x = w_x·(g·(out_x − out) + g_lse)``."""
    acc = lse_a.dtype
    g, o = grad_out.to(acc), out.to(acc)
    weight_a, weight_b = _merge_weights(lse_a, lse_b, lse)
    grad_lse_a = weight_a * ((g * (out_a.to(acc) - o)).sum(-1) + grad_lse)
    grad_lse_b = weight_b * ((g * (out_b.to(acc) - o)).sum(-1) + grad_lse)
    grads = ((weight_a[..., None] * g).to(out_a.dtype), grad_lse_a, (weight_b[..., None] * g).to(out_b.dtype), grad_lse_b)
    return tuple(t.contiguous() for t in grads)


# ---- the general op: attention mask, causal order, dropout, grouped heads


def _key_chunks(S: int, L: int, chunk_size: int, band: Band):
    """Key ranges ``[n0, n1)`` that some query may attend: within the band's keys (causal calls stop at the
    last query's diagonal key, windows start at the first query's first key)."""
    first, last = band.keys(L, S)
    for n0 in range(first, last, chunk_size):
        yield n0, min(last, n0 + chunk_size)


def _dropout_scale(seed: Optional[Tensor], dropout_p: float, shape, n0: int, n1: int, acc, device) -> Optional[Tensor]:
    """``keep / (1 − p)`` of the chunk's pairs, or None without dropout."""
    if dropout_p == 0.0:
        return None
    keep = keep_mask(seed, dropout_p, shape, n0, n1 - n0, device=device)
    return keep.to(acc) / (1.0 - dropout_p)


def attention_forward(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor],
                      scale: float, is_causal: bool, dropout_p: float, dropout_seed: Optional[Tensor],
                      chunk_size: int, window_left: int = -1, window_right: int = -1,
                      diagonal: int = 0, softcap: float = 0.0,
                      alibi_slopes: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(out [B, Hq, L, Dv], lse [B, Hq, L])``; a row with no pair taking part is ``(0, −inf)``. The band
    (``is_causal``, ``window_left``, ``window_right``, ``diagonal``) as :meth:`Band.of` reads it; the soft cap and
    ALiBi as :class:`ScoreMod`."""
    band = Band.of(is_causal, window_left, window_right, diagonal)
    mod = ScoreMod(softcap, alibi_slopes, diagonal)
    acc = accumulation_dtype(q.dtype)
    B, Hq, L, _ = q.shape
    S, Dv = k.shape[2], v.shape[3]
    qf = q.to(acc)
    kx, vx = expand_heads(k, Hq), expand_heads(v, Hq)
    running_max = torch.full((B, Hq, L), -math.inf, dtype=acc, device=q.device)
    running_sum = torch.zeros((B, Hq, L), dtype=acc, device=q.device)
    out = torch.zeros((B, Hq, L, Dv), dtype=acc, device=q.device)
    for n0, n1 in _key_chunks(S, L, chunk_size, band):
        allowed, bias = chunk_rules(attn_mask, key_padding_mask, band, n0, n1, L, acc, q.device)
        scores = masked_scores(qf, kx[:, :, n0:n1].to(acc), scale, allowed, bias, mod, n0)
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


def row_normaliser(qf: Tensor, kx: Tensor, attn_mask, key_padding_mask, band: Band, lse: Tensor, scale: float,
                   chunk_size: int, mod: Optional[ScoreMod] = None) -> Tuple[Tensor, Tensor]:
    """``(shift, log_sum)`` with ``P = exp((s − shift) − log_sum)``: the saved lse, except rows with
    |lse| ≥ 512, whose exact (max, log Σ) are recomputed (the fp32 lse has rounded log Σ away there)."""
    precise = torch.isfinite(lse) & (lse.abs() >= PRECISE_NORMALISER_LSE)
    if not bool(precise.any()):
        return lse[..., None], torch.zeros_like(lse)[..., None]
    L, S = qf.shape[2], kx.shape[2]
    row_max = torch.full_like(lse, -math.inf)
    total = torch.zeros_like(lse)
    for n0, n1 in _key_chunks(S, L, chunk_size, band):
        allowed, bias = chunk_rules(attn_mask, key_padding_mask, band, n0, n1, L, qf.dtype, qf.device)
        scores = masked_scores(qf, kx[:, :, n0:n1].to(qf.dtype), scale, allowed, bias, mod, n0)
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
                       chunk_size: int, window_left: int = -1, window_right: int = -1,
                       diagonal: int = 0, softcap: float = 0.0,
                       alibi_slopes: Optional[Tensor] = None, bias_grad=None) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of q, k, v (FlashAttention's backward with the dropout mask regenerated):
    ``dV = (P∘Z)ᵀ dO``, ``dP = (dO Vᵀ)∘Z``, ``dS = P∘(dP − Δ + dlse)``, ``Δ = rowsum(dO∘out)``.
    Pairs that take no part, and empty rows, contribute exactly 0. ``bias_grad`` (optional, an object with
    ``add(grad_scores, n0, n1)``, :class:`~.bias_grad.BiasGradient`) receives each key chunk's ``dS`` (the gradient
    of the additive mask, the soft cap's factor not applied: the mask is added after the cap)."""
    band = Band.of(is_causal, window_left, window_right, diagonal)
    mod = ScoreMod(softcap, alibi_slopes, diagonal)
    acc = accumulation_dtype(q.dtype)
    B, Hq, L, _ = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qf, dout = q.to(acc), grad_out.to(acc)
    lse = lse.to(acc)
    kx, vx = expand_heads(k, Hq), expand_heads(v, Hq)
    empty_row = (lse == -math.inf)[..., None]
    shift, log_sum = row_normaliser(qf, kx, attn_mask, key_padding_mask, band, lse, scale, chunk_size, mod)
    delta_minus_dlse = (dout * out.to(acc)).sum(dim=-1) - grad_lse.to(acc)
    grad_q = torch.zeros_like(qf, memory_format=torch.contiguous_format)  # as the fake kernel declares
    grad_k = torch.zeros((B, Hq) + tuple(k.shape[2:]), dtype=acc, device=q.device)
    grad_v = torch.zeros((B, Hq) + tuple(v.shape[2:]), dtype=acc, device=q.device)
    for n0, n1 in _key_chunks(S, L, chunk_size, band):
        allowed, bias = chunk_rules(attn_mask, key_padding_mask, band, n0, n1, L, acc, q.device)
        k_chunk, v_chunk = kx[:, :, n0:n1].to(acc), vx[:, :, n0:n1].to(acc)
        scores, tanh = masked_scores_and_tanh(qf, k_chunk, scale, allowed, bias, mod, n0)
        # Zero outside too: a NaN row's lse would make exp(−inf − NaN) = NaN on its masked pairs.
        probs = zero_outside(torch.where(empty_row, torch.zeros_like(scores), torch.exp((scores - shift) - log_sum)),
                             allowed)
        dropped = _dropout_scale(dropout_seed, dropout_p, (B, Hq, L, S), n0, n1, acc, q.device)
        kept = probs if dropped is None else probs * dropped
        grad_v[:, :, n0:n1] = weighted_columns(kept, allowed, dout)
        grad_probs = torch.matmul(dout, v_chunk.transpose(-1, -2))
        if dropped is not None:
            grad_probs = grad_probs * dropped
        grad_scores = probs * (grad_probs - delta_minus_dlse[..., None])
        if bias_grad is not None:
            bias_grad.add(zero_outside(grad_scores, allowed), n0, n1)
        if tanh is not None:  # through s = c · tanh(s₀ / c)
            grad_scores = grad_scores * (1 - tanh * tanh)
        grad_scores = zero_outside(grad_scores, allowed)
        grad_q = grad_q + scale * weighted_rows(grad_scores, allowed, k_chunk)
        grad_k[:, :, n0:n1] = scale * weighted_columns(grad_scores, allowed, qf)
    return grad_q.to(q.dtype), sum_heads(grad_k, Hkv).to(k.dtype), sum_heads(grad_v, Hkv).to(v.dtype)
