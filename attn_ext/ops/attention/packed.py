"""The reference of a packed (varlen) batch as the attention ops take it (``cu_seqlens_q``, ``cu_seqlens_k``,
``bottom_right``): ``q [1, H, total_q, D]``, ``k, v [1, Hkv, total_k, ·]``, sequence ``s``'s query rows
``cu_q[s] .. cu_q[s + 1]`` attending its key rows ``cu_k[s] .. cu_k[s + 1]`` only, each sequence computed by the
unpacked reference (:mod:`.naive`, :mod:`.composite`) on views of its rows. No dropout (the public
``varlen_attention`` runs dropout one sequence at a time) and no attn_mask or key padding, as the C++ ops.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from attn_ext.ops.utils.dtypes import accumulation_dtype

__all__ = ["check_packed_args", "checked_offsets", "packed_backward", "packed_composite", "packed_forward", "segments"]

_OP = "attn_ext.varlen_attention"


def checked_offsets(cu: Tensor, name: str, total: int, batch: Optional[int] = None) -> List[int]:
    """The host copy of a checked ``cu_seqlens`` (int32 ``[B + 1]``, from 0, non-decreasing, ending at ``total``;
    ``batch`` sequences when given)."""
    if not isinstance(cu, Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
        got = type(cu).__name__ if not isinstance(cu, Tensor) else f"{cu.dtype} of shape {tuple(cu.shape)}"
        raise TypeError(f"{_OP}: {name} must be an int32 tensor [B + 1] of sequence offsets, got {got}")
    offsets = [int(x) for x in cu.tolist()]
    if batch is not None and len(offsets) != batch + 1:
        raise ValueError(f"{_OP}: cu_seqlens_q and cu_seqlens_k must describe the same number of sequences; got "
                         f"{batch} and {len(offsets) - 1}")
    if offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])) or offsets[-1] != total:
        raise ValueError(f"{_OP}: {name} must start at 0, never decrease and end at the number of packed rows "
                         f"({total}); got {offsets}")
    return offsets


def segments(cu_q: Tensor, cu_k: Tensor, total_q: int, total_k: int) -> List[Tuple[int, int, int, int]]:
    """``[(q0, q1, k0, k1)]`` of checked offsets (:func:`checked_offsets`)."""
    oq = checked_offsets(cu_q, "cu_seqlens_q", total_q)
    ok = checked_offsets(cu_k, "cu_seqlens_k", total_k, len(oq) - 1)
    return [(oq[s], oq[s + 1], ok[s], ok[s + 1]) for s in range(len(oq) - 1)]


def check_packed_args(q: Tensor, diagonal: int, dropout_p: float, attn_mask, key_padding_mask) -> None:
    if q.shape[0] != 1:
        raise ValueError(f"{_OP}: a packed batch is q [1, H, total_q, D], got {tuple(q.shape)}")
    if diagonal != 0:
        raise ValueError(f"{_OP}: the diagonal of a packed batch is per sequence (bottom_right), got {diagonal}")
    if attn_mask is not None or key_padding_mask is not None:
        raise ValueError(f"{_OP}: a packed batch takes no attn_mask or key padding mask")
    if dropout_p > 0:
        raise ValueError(f"{_OP}: a packed batch takes no dropout here (ae.varlen_attention runs dropout one "
                         "sequence at a time)")


def _per_sequence(q: Tensor, k: Tensor, cu_q: Tensor, cu_k: Tensor, alibi_slopes: Optional[Tensor],
                  bottom_right: bool):
    """``(q0, q1, k0, k1, diagonal, slopes [1, H] or None)`` of each sequence."""
    for s, (q0, q1, k0, k1) in enumerate(segments(cu_q, cu_k, q.shape[2], k.shape[2])):
        diag = (k1 - k0) - (q1 - q0) if bottom_right else 0
        yield q0, q1, k0, k1, diag, None if alibi_slopes is None else alibi_slopes[s:s + 1]


def packed_forward(forward: Callable, q: Tensor, k: Tensor, v: Tensor, scale: float, is_causal: bool,
                   chunk_size: int, window_left: int, window_right: int, softcap: float,
                   alibi_slopes: Optional[Tensor], cu_q: Tensor, cu_k: Tensor,
                   bottom_right: bool) -> Tuple[Tensor, Tensor]:
    """``(out [1, H, total_q, Dv], lse [1, H, total_q])`` by ``forward`` (an unpacked forward's signature) per sequence."""
    outs, lses = [], []
    for q0, q1, k0, k1, diag, slopes in _per_sequence(q, k, cu_q, cu_k, alibi_slopes, bottom_right):
        out, lse = forward(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], None, None, scale, is_causal, 0.0, None,
                           chunk_size, window_left, window_right, diag, softcap, slopes)
        outs.append(out), lses.append(lse)
    if not outs:
        return q.new_zeros(q.shape[:3] + (v.shape[3],)), q.new_zeros(q.shape[:3], dtype=accumulation_dtype(q.dtype))
    return torch.cat(outs, 2), torch.cat(lses, 2)


def packed_backward(backward: Callable, grad_out: Tensor, grad_lse: Tensor, q: Tensor, k: Tensor, v: Tensor,
                    out: Tensor, lse: Tensor, scale: float, is_causal: bool, chunk_size: int, window_left: int,
                    window_right: int, softcap: float, alibi_slopes: Optional[Tensor], cu_q: Tensor, cu_k: Tensor,
                    bottom_right: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """The gradients of q, k, v by ``backward`` (an unpacked backward's signature) per sequence."""
    grad_q = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    grad_k = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    grad_v = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    for q0, q1, k0, k1, diag, slopes in _per_sequence(q, k, cu_q, cu_k, alibi_slopes, bottom_right):
        gq, gk, gv = backward(grad_out[:, :, q0:q1], grad_lse[:, :, q0:q1], q[:, :, q0:q1], k[:, :, k0:k1],
                              v[:, :, k0:k1], None, None, out[:, :, q0:q1], lse[:, :, q0:q1], scale, is_causal, 0.0,
                              None, chunk_size, window_left, window_right, diag, softcap, slopes)
        grad_q[:, :, q0:q1], grad_k[:, :, k0:k1], grad_v[:, :, k0:k1] = gq, gk, gv
    return grad_q, grad_k, grad_v


def packed_composite(composite: Callable, inputs: Sequence, outputs: Sequence[Tensor]) -> Tuple[Tensor, Tensor]:
    """The differentiable composite of a packed call: ``composite`` (the unpacked one) per sequence, concatenated."""
    q, k, v = inputs[:3]
    scale, is_causal, chunk_size, window_left, window_right = inputs[5], inputs[6], inputs[9], inputs[10], inputs[11]
    softcap, alibi_slopes, cu_q, cu_k, bottom_right = inputs[13], inputs[14], inputs[15], inputs[16], inputs[17]
    outs, lses = [], []
    for q0, q1, k0, k1, diag, slopes in _per_sequence(q, k, cu_q, cu_k, alibi_slopes, bottom_right):
        seq_inputs = (q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], None, None, scale, is_causal, 0.0, None,
                      chunk_size, window_left, window_right, diag, softcap, slopes)
        out, lse = composite(seq_inputs, None)
        outs.append(out), lses.append(lse)
    if not outs:
        return q.new_zeros(q.shape[:3] + (v.shape[3],)), q.new_zeros(q.shape[:3], dtype=accumulation_dtype(q.dtype))
    return torch.cat(outs, 2), torch.cat(lses, 2)
