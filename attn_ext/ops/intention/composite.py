"""Differentiable PyTorch compositions of the Intention ops, for derivatives beyond the first order.

The fused kernels give first derivatives (and ignore gradients reaching the intermediate factor and
weights); second derivatives, forward-mode tangents, ``torch.func`` transforms and gradients through the
intermediates differentiate these instead (see :mod:`attn_ext.ops.utils.autograd`). The Cholesky
factorisation and solve are PyTorch's, which are differentiable to any order.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from attn_ext.ops.utils.dense_attention import dense_attention
from attn_ext.ops.utils.dtypes import accumulation_dtype


def ridge(q: Tensor, k: Tensor, v: Optional[Tensor], key_padding_mask: Optional[Tensor], alpha: Tensor,
          scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """``(scale·Q W, L, W)`` with ``L Lᵀ = KᵀK + αI`` and ``W = (KᵀK + αI)⁻¹ KᵀV`` (``V = I`` when None)."""
    acc = accumulation_dtype(q.dtype)
    kf = k.to(acc)
    if key_padding_mask is not None:  # a padded key is never read: zeroed, not multiplied (NaN·0 is NaN)
        kf = kf.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    D = k.shape[-1]
    eye = torch.eye(D, dtype=acc, device=k.device)
    system = kf.transpose(-1, -2) @ kf + alpha.to(acc)[..., None, None] * eye
    factor = torch.linalg.cholesky_ex(system)[0]
    if v is None:
        rhs = eye.expand(*system.shape)
    else:
        vf = v.to(acc)
        if key_padding_mask is not None:
            vf = vf.masked_fill(key_padding_mask[:, None, :, None], 0.0)
        rhs = kf.transpose(-1, -2) @ vf
    weights = torch.cholesky_solve(rhs, factor)
    out = scale * (q.to(acc) @ weights)
    return out.to(q.dtype), factor, weights


def intention(inputs: Sequence, outputs: Sequence[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """The composite of ``intention_fwd(q, k, v, key_padding_mask, alpha, scale)``."""
    return ridge(*inputs)


def sigma_intention(inputs: Sequence, outputs: Sequence[Tensor]) -> Tuple[Tensor, ...]:
    """The composite of ``sigma_intention_fwd``: ``(out, lse, q̃, L, (KᵀK + αI)⁻¹)``."""
    q, k, v, key_padding_mask, alpha, scale, _chunk_size = inputs
    q_tilde, factor, inverse = ridge(q, k, None, key_padding_mask, alpha, scale)
    out, lse = dense_attention(q_tilde, k, v, key_padding_mask, 1.0)
    return out.to(q.dtype), lse, q_tilde, factor, inverse


def spd_solve(inputs: Sequence, outputs: Sequence[Tensor]) -> Tuple[Tensor]:
    """The composite of ``batched_spd_solve(A, B)``: only A's lower triangle is read, as by the kernel."""
    A, B = inputs
    lower = A.tril()
    symmetric = lower + lower.tril(-1).transpose(-1, -2)
    return (torch.cholesky_solve(B, torch.linalg.cholesky_ex(symmetric)[0]),)
