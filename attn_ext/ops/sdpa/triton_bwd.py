"""Triton backward of the attention op pair (``attention_bwd_triton``), FlashAttention-2 style with the
forward's masks, causal rule, dropout and grouped key/value heads.

The kernels are the cross-attention backward kernels with their per-pair flags on
(:mod:`attn_ext.ops.cross_attention.triton_bwd`): deterministic, no atomics; dK/dV of a key/value
head is the sum over its group of query heads, accumulated by one program.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from attn_ext.ops.cross_attention.triton_bwd import has_saturated_rows, launch_backward
from attn_ext.ops.sdpa.triton_args import check_attention_args

__all__ = ["attention_backward"]


def attention_backward(grad_out: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
                       attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], out: Tensor, lse: Tensor,
                       scale: float, is_causal: bool, dropout_p: float, dropout_seed: Optional[Tensor],
                       chunk_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`attn_ext.ops.sdpa.triton_fwd.attention_forward` (Triton, deterministic).

    Parameters
    ----------
    grad_out : torch.Tensor
        ``[B, Hq, L, Dv]`` gradient of ``out``, q's dtype, any strides.
    grad_lse : torch.Tensor or None
        ``[B, Hq, L]`` gradient of ``lse`` (read as float32, any strides); None means zeros.
    q, k, v, attn_mask, key_padding_mask, scale, is_causal, dropout_p, dropout_seed, chunk_size
        The forward's arguments (the same seed: dropout drops the same pairs).
    out, lse : torch.Tensor
        The forward's results.

    Returns
    -------
    grad_q, grad_k, grad_v : torch.Tensor
        Contiguous, shapes and dtypes of q, k, v. Pairs that are not allowed contribute nothing;
        padded keys, keys no query attends and rows without an allowed key get exactly zero.

    Notes
    -----
    ``dV = (P∘Z)ᵀ dO``, ``dS = P ∘ ((dO Vᵀ)∘Z − Δ + dlse)``, ``Δ = rowsum(dO ∘ out)``, ``Z`` the
    keep mask over ``1 − p``, in float32. Rows whose finite ``lse`` reaches 512 in magnitude (fp32
    has rounded their ``log(sum)`` away) run the reference backward instead, as cross attention does.
    """
    check_attention_args(q, k, v, attn_mask, key_padding_mask, scale, dropout_p, dropout_seed, chunk_size)
    if has_saturated_rows(lse):
        grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
        grads = torch.ops.attn_ext.attention_bwd_reference(grad_out, grad_lse, q, k, v, attn_mask, key_padding_mask,
                                                           out, lse, scale, is_causal, dropout_p, dropout_seed,
                                                           chunk_size)
        return tuple(g.contiguous() for g in grads)
    return launch_backward(grad_out, grad_lse, q, k, v, key_padding_mask, out, lse, scale, chunk_size,
                           attn_mask=attn_mask, is_causal=is_causal, dropout_p=float(dropout_p),
                           dropout_seed=dropout_seed)
