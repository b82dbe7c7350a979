"""``attn_ext.varlen_attention``: attention over a packed batch of sequences of different lengths, FlashAttention's
``flash_attn_varlen_func`` layout (``q [total_q, H, D]`` with ``cu_seqlens_q [B + 1]``), with no padding formed.

On every backend the whole packed batch is one call of op ``attention_fwd`` with ``cu_seqlens_q/k``: the kernels'
work tiles follow the sequences (no tile spans two), each tile attends only its sequence's keys, so each sequence's
work is proportional to its own lengths and no padding is formed (the Triton kernels: :mod:`.triton_varlen`; the
CUDA kernels: each block reads its sequence's offsets, csrc/cuda/common/packed_sequences.h). With dropout each
sequence runs :func:`~attn_ext.scaled_dot_product_attention` on views of its own rows, one call each. Every keyword of that
function that applies per sequence applies here: the causal rule and sliding windows aligned per sequence, the
soft cap, ALiBi, dropout, grouped key/value heads; derivatives of every order.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from attn_ext.ops.attention.chunked import DEFAULT_CHUNK_SIZE
from attn_ext.ops.attention.errors import named_after
from attn_ext.ops.attention.packed import checked_offsets
from attn_ext.ops.attention.registration import PACKED_BACKENDS, SCALED_DOT_PRODUCT_ATTENTION
from attn_ext.ops.attention.scaled_dot_product import (alibi_slopes_for, check_qkv, scaled_dot_product_attention,
                                                       softcap_value, window_sides)
from attn_ext.ops.utils import dispatch
from attn_ext.ops.utils.validation import check_chunk_size, check_scale

__all__ = ["varlen_attention"]

_OP = "attn_ext.varlen_attention"


def _check_max(max_seqlen: Optional[int], lengths: List[int], name: str) -> None:
    if max_seqlen is not None and lengths and max_seqlen < max(lengths):
        raise ValueError(f"{_OP}: {name} = {max_seqlen} but a sequence has {max(lengths)} rows")


def _fused(q, k, v, cu_q, cu_k, dropout_p, is_causal, scale, window_size, softcap, alibi_slopes, alignment,
           chunk_size, backend, batch) -> Optional[Tuple[Tensor, Tensor]]:
    """``(out, lse)`` of one packed call of op ``attention_fwd``, or None where that does not apply (dropout, or a
    backend without packed batches): the arguments are checked as :func:`scaled_dot_product_attention` does."""
    if dropout_p != 0.0:
        return None
    heads = q.shape[1]
    # [rows, heads, dim] -> [1, heads, rows, dim]: views, read through their strides
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))
    check_qkv(q4, k4, v4, enable_gqa=True)
    if not isinstance(is_causal, bool):
        raise TypeError(f"{_OP}: is_causal must be a bool, got {type(is_causal).__name__}")
    window_left, window_right = window_sides(window_size, alignment, is_causal)
    softcap = softcap_value(softcap)
    slopes = None
    if alibi_slopes is not None:  # [H] or [B, H]: as SDPA's (..., Hq) for a batch of B sequences
        slopes = alibi_slopes_for(alibi_slopes, torch.empty((batch, heads, 1, 1), device=q.device))
    name = dispatch.select_backend(SCALED_DOT_PRODUCT_ATTENTION, backend, q4, dropout_p=0.0)
    if name not in PACKED_BACKENDS:
        return None
    scale = check_scale(scale, "varlen_attention")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    chunk_size = check_chunk_size(chunk_size, "varlen_attention") or DEFAULT_CHUNK_SIZE
    out, lse = dispatch.entry(SCALED_DOT_PRODUCT_ATTENTION, name)(
        q4, k4, v4, None, None, scale, is_causal, 0.0, None, chunk_size, window_left, window_right, 0, softcap, slopes,
        cu_q.to(q.device), cu_k.to(q.device), alignment == "bottom_right")
    return out[0].transpose(0, 1), lse[0]


@named_after("varlen_attention")
def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    *,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    window_size: Optional[Tuple[int, int]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    alignment: str = "top_left",
    return_lse: bool = False,
    chunk_size: Optional[int] = None,
    backend: Optional[str] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention of each packed sequence's queries over its own keys.

    Parameters
    ----------
    q : Tensor
        ``[total_q, H, D]``: the queries of every sequence, one after another (sequence ``b`` holds rows
        ``cu_seqlens_q[b]`` to ``cu_seqlens_q[b + 1]``).
    k, v : Tensor
        ``[total_k, Hkv, D]`` and ``[total_k, Hkv, Dv]``, likewise by ``cu_seqlens_k``; ``H`` a multiple of
        ``Hkv`` (grouped heads).
    cu_seqlens_q, cu_seqlens_k : Tensor
        int32 ``[B + 1]``: cumulative sequence lengths, from 0 to ``total_q`` / ``total_k``.
    max_seqlen_q, max_seqlen_k : int, optional
        FlashAttention's hints; checked (at least the longest sequence) and otherwise not needed.
    dropout_p, is_causal, scale, window_size, softcap, alignment, chunk_size, backend
        As for :func:`attn_ext.scaled_dot_product_attention`, per sequence (``alignment="bottom_right"`` puts
        each sequence's queries at the end of its own keys).
    alibi_slopes : Tensor, optional
        float32 ``[H]`` or ``[B, H]`` (per sequence).
    return_lse : bool
        Also return the log-sum-exp ``[H, total_q]`` (FlashAttention's layout).

    Returns
    -------
    Tensor or (Tensor, Tensor)
        ``out [total_q, H, Dv]`` in q's dtype, and ``lse [H, total_q]`` if ``return_lse``.

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> lengths = [3, 10, 7]
    >>> cu = torch.tensor([0, 3, 13, 20], dtype=torch.int32)
    >>> q, k, v = (torch.randn(20, 4, 16) for _ in range(3))
    >>> out = ae.varlen_attention(q, k, v, cu, cu, is_causal=True)
    >>> ref = ae.scaled_dot_product_attention(q[3:13].transpose(0, 1), k[3:13].transpose(0, 1),
    ...                                       v[3:13].transpose(0, 1), is_causal=True)
    >>> bool(torch.allclose(out[3:13], ref.transpose(0, 1), atol=1e-6))
    True
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{_OP}: {name} must be a packed [total, heads, dim] tensor, got {shape}")
    if k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1]:
        raise ValueError(f"{_OP}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same rows and heads")
    starts_q = checked_offsets(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
    starts_k = checked_offsets(cu_seqlens_k, "cu_seqlens_k", k.shape[0], len(starts_q) - 1)
    batch = len(starts_q) - 1
    _check_max(max_seqlen_q, [b - a for a, b in zip(starts_q, starts_q[1:])], "max_seqlen_q")
    _check_max(max_seqlen_k, [b - a for a, b in zip(starts_k, starts_k[1:])], "max_seqlen_k")
    heads = q.shape[1]
    if alibi_slopes is not None and isinstance(alibi_slopes, Tensor) and alibi_slopes.dim() == 2 and \
            tuple(alibi_slopes.shape) != (batch, heads):
        raise ValueError(f"{_OP}: alibi_slopes must be [H] = [{heads}] or [B, H] = [{batch}, {heads}], got "
                         f"{tuple(alibi_slopes.shape)}")
    fused = _fused(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, is_causal, scale, window_size, softcap,
                   alibi_slopes, alignment, chunk_size, backend, batch)
    if fused is not None:
        out, lse = fused
        return (out, lse) if return_lse else out
    outs, lses = [], []
    for b in range(batch):
        # [rows, heads, dim] -> [heads, rows, dim]: a view, read in place through its strides
        qb, kb, vb = (t[s0:s1].transpose(0, 1) for t, s0, s1 in ((q, starts_q[b], starts_q[b + 1]),
                                                                 (k, starts_k[b], starts_k[b + 1]),
                                                                 (v, starts_k[b], starts_k[b + 1])))
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        out, lse = scaled_dot_product_attention(
            qb, kb, vb, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=kb.shape[0] != heads,
            return_lse=True, chunk_size=chunk_size, backend=backend, alignment=alignment, window_size=window_size,
            softcap=softcap, alibi_slopes=slopes)
        outs.append(out.transpose(0, 1))
        lses.append(lse)
    if not outs:  # no sequence: the empty attention of the (empty) rows, still in the autograd graph
        out, lse = scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                enable_gqa=k.shape[1] != heads, return_lse=True, backend=backend)
        out = out.transpose(0, 1)
    else:
        out, lse = torch.cat(outs, 0), torch.cat(lses, 1)
    return (out, lse) if return_lse else out
