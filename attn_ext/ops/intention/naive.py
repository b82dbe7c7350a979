"""Readable PyTorch reference of Intention and σIntention (docs/spec.md §4).

Everything is batched over ``[B, H]``; the kernels (csrc/cpu/intention*.cpp, the Triton kernels of this folder) are
tested against these functions, and these against an independent least-squares solve in the tests.

Notation: ``K [N, D]``, ``V [N, Dv]``, ``Q [M, D]`` per (batch, head); masked keys are dropped, which
is the same as zeroing their rows of ``K`` and ``V``.

* statistics ``G = KᵀK`` (``[D, D]``) and ``C = KᵀV`` (``[D, Dv]``), additive over key chunks;
* primal form ``out = scale·Q (G + αI)⁻¹ C`` (a D×D solve);
* dual form ``out = scale·Q Kᵀ (KKᵀ + αI)⁻¹ V`` (an N×N solve), equal for α > 0 by the push-through
  identity ``(KᵀK + αI)⁻¹Kᵀ = Kᵀ(KKᵀ + αI)⁻¹``;
* σIntention ``softmax(scale·Q (G + αI)⁻¹ Kᵀ) V``, an ordinary softmax attention of the transformed
  queries ``Q̃ = scale·Q (G + αI)⁻¹`` with score scale 1.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


def masked_keys(k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """``k``, ``v`` with the rows of padding keys zeroed (``key_padding_mask [B, N]``, True = padding)."""
    if key_padding_mask is None:
        return k, v
    keep = (~key_padding_mask)[:, None, :, None].to(k.dtype)
    return k * keep, v * keep


def statistics(k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(G = KᵀK [B, H, D, D], C = KᵀV [B, H, D, Dv])`` over the valid keys, in the input dtype."""
    k, v = masked_keys(k, v, key_padding_mask)
    kt = k.transpose(-1, -2)
    return kt @ k, kt @ v


def regularised(gram: Tensor, alpha: Tensor) -> Tensor:
    """``G + αI`` with ``alpha`` broadcast per ``[B, H]``."""
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    return gram + alpha[..., None, None] * eye


def solve_regularised(gram: Tensor, alpha: Tensor, rhs: Tensor) -> Tensor:
    """``(G + αI)⁻¹ rhs`` by Cholesky; a factorisation that fails raises ``ValueError`` naming where.

    With α = 0 and fewer valid keys than D (or collinear keys) the Gram matrix is singular: that is
    an error, never a NaN result.
    """
    factor, info = torch.linalg.cholesky_ex(regularised(gram, alpha))
    if info.device.type != "meta" and bool((info != 0).any()):
        where = (info != 0).nonzero()[0].tolist()
        raise ValueError(
            f"attn_ext: KᵀK + αI is not positive definite at [batch, head] = {where} (Cholesky failed at column "
            f"{int(info[tuple(where)]) - 1} of {gram.shape[-1]}); with alpha = 0 this happens when there are fewer "
            "valid keys than D or the keys are collinear: use alpha > 0"
        )
    return torch.cholesky_solve(rhs, factor)


def intention_primal(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, key_padding_mask: Optional[Tensor] = None,
                     scale: float = 1.0) -> Tensor:
    """``scale·Q (KᵀK + αI)⁻¹ KᵀV``, ``alpha [B, H]``: a D×D Cholesky solve."""
    gram, cross = statistics(k, v, key_padding_mask)
    return scale * (q @ solve_regularised(gram, alpha, cross))


def intention_dual(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, key_padding_mask: Optional[Tensor] = None,
                   scale: float = 1.0) -> Tensor:
    """``scale·Q Kᵀ (KKᵀ + αI)⁻¹ V``; padding keys get a unit diagonal so that their zero rows stay out."""
    k, v = masked_keys(k, v, key_padding_mask)
    kernel = k @ k.transpose(-1, -2)
    diag = alpha[..., None].expand(*alpha.shape, k.shape[-2])
    if key_padding_mask is not None:
        # A padding key's row and column of KKᵀ are 0 and its value row is 0; any positive diagonal
        # keeps the system regular without changing the solution (its coefficient solves to 0).
        diag = torch.where(key_padding_mask[:, None, :], torch.ones_like(diag), diag)
    system = kernel + torch.diag_embed(diag)
    zero = torch.zeros_like(alpha)
    return scale * ((q @ k.transpose(-1, -2)) @ solve_regularised(system, zero, v))


def transformed_queries(q: Tensor, k: Tensor, alpha: Tensor, key_padding_mask: Optional[Tensor] = None,
                        scale: float = 1.0) -> Tensor:
    """``Q̃ = scale·Q (KᵀK + αI)⁻¹`` (``A`` is symmetric, so ``Q̃ = scale·(A⁻¹Qᵀ)ᵀ``)."""
    gram, _ = statistics(k, k[..., :0], key_padding_mask)
    return scale * solve_regularised(gram, alpha, q.transpose(-1, -2)).transpose(-1, -2)


def sigma_intention(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, key_padding_mask: Optional[Tensor] = None,
                    scale: float = 1.0) -> Tensor:
    """``softmax(Q̃ Kᵀ) V`` over the valid keys; a row without valid keys gives 0."""
    q_tilde = transformed_queries(q, k, alpha, key_padding_mask, scale)
    scores = q_tilde @ k.transpose(-1, -2)
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        empty = key_padding_mask.all(dim=-1)[:, None, None, None]
        scores = scores.masked_fill(empty, 0.0)
    weights = torch.softmax(scores, dim=-1)
    if key_padding_mask is not None:
        weights = weights.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    return weights @ v
