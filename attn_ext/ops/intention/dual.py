"""The dual (N×N) forms of Intention and σIntention: the systems of the keys' inner products.

By the push-through identity ``(KᵀK + αI)⁻¹Kᵀ = Kᵀ(KKᵀ + αI)⁻¹`` (α > 0):

* Intention ``scale·Q (KᵀK + αI)⁻¹ KᵀV = scale·(QKᵀ) Z`` with ``(KKᵀ + αI) Z = V``;
* σIntention's scores ``scale·Q (KᵀK + αI)⁻¹ Kᵀ = scale·(QKᵀ)(KKᵀ + αI)⁻¹``, then the softmax over the
  keys and the values. The transformed queries ``Q̃ = scale·Q (KᵀK + αI)⁻¹`` are never formed: with
  fewer keys than D their component outside the keys' span is of size ``‖Q‖/α``, and the product
  ``Q̃Kᵀ`` would cancel it only up to a rounding error of that size.

:mod:`.conditioning` says when (fewer valid keys than D and a small ridge); :func:`valid_keys_first`
then keeps the system small: such a head has at most D − 1 valid keys, so with padding only the
first ``D − 1`` keys after moving the valid ones forward are needed, whatever N is.

Padding keys get a unit diagonal and zero rows (their coefficient solves to 0). NaN rules as in
:mod:`.naive`: a NaN/inf valid key or value makes its (batch, head) NaN, a NaN/inf query row its row.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from attn_ext.ops.intention import naive as reference
from attn_ext.ops.utils.concrete import check_on_device, concrete, tracing


def valid_keys_first(k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor],
                     keep: int) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """``k``, ``v`` and the mask with every batch entry's valid keys moved to the front (in their order),
    cut to the first ``keep`` keys. Heads with more than ``keep`` valid keys lose some: only call it for
    heads that have at most ``keep``. Without a mask, or with ``keep >= N``, nothing changes."""
    N = k.shape[2]
    if key_padding_mask is None or keep >= N:
        return k, v, key_padding_mask
    order = torch.argsort(key_padding_mask.to(torch.int8), dim=1, stable=True)[:, :keep]     # [B, keep]
    B, H = k.shape[:2]
    take = lambda t: t.gather(2, order[:, None, :, None].expand(B, H, keep, t.shape[-1]))  # noqa: E731
    return take(k), take(v), key_padding_mask.gather(1, order)


def _solve(k: Tensor, rhs: Tensor, key_padding_mask: Optional[Tensor], alpha: Tensor, op: str) -> Tuple[Tensor, Tensor]:
    """``((KKᵀ + diag(α, or 1 at padding))⁻¹ rhs, nan)`` per ``[B, H]``, with ``nan``
    (:func:`~attn_ext.ops.intention.naive.nan_unless_finite` of ``KKᵀ``) NaN on the heads whose ``KKᵀ`` is not
    finite: their factorisation may fail and their solution is garbage, which the callers make NaN.

    ``α > 0`` on every head, so any other head is positive definite in exact arithmetic; a factorisation
    that still fails (repeated keys with a ridge below the rounding of ``KKᵀ``) raises, naming ``op``.
    """
    kernel = k @ k.transpose(-1, -2)
    nan = reference.nan_unless_finite(kernel, (-2, -1))
    diag = alpha[..., None].expand(*alpha.shape, k.shape[-2])
    if key_padding_mask is not None:
        diag = torch.where(key_padding_mask[:, None, :], torch.ones_like(diag), diag)
    factor, info = torch.linalg.cholesky_ex(kernel + torch.diag_embed(diag))
    _check_factorised(op, info, nan, k.shape[-2])
    return torch.cholesky_solve(rhs, factor), nan


def _check_factorised(op: str, info: Tensor, nan: Tensor, n: int) -> None:
    """Raise for a failed factorisation of a finite head (one host sync, and only the rare failure reads more)."""
    if info.device.type == "meta":
        return
    if tracing():
        check_on_device((info == 0) | torch.isnan(nan), f"attn_ext.{op}: the dual system KKᵀ + αI is not positive "
                        "definite (repeated keys with a ridge below the rounding of KKᵀ); use a larger alpha")
        return
    failed = (concrete(info) != 0) & ~torch.isnan(concrete(nan))
    if bool(failed.any()):
        index = tuple(failed.nonzero()[0].tolist())
        column = int(concrete(info)[index]) - 1
        raise RuntimeError(
            f"attn_ext.{op}: KᵀK + αI is singular at [batch, head] = [{index[-2]}, {index[-1]}]: its dual system "
            f"KKᵀ + αI (the {n} keys' inner products) has a Cholesky pivot of column {column} that is not "
            "positive: repeated or collinear keys with a ridge below the rounding of KKᵀ. Use a larger alpha")


def intention_dual(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, key_padding_mask: Optional[Tensor],
                   scale: float, op: str = "intention") -> Tensor:
    """``scale·Q Kᵀ (KKᵀ + αI)⁻¹ V`` per ``[B, H]``, ``alpha > 0`` (``[B, H]``), in the inputs' dtype."""
    k, v = reference.masked_keys(k, v, key_padding_mask)
    coefficients, nan = _solve(k, v, key_padding_mask, alpha, op)
    # α·nan: NaN exactly on the non-finite heads (keys or values), and α's gradient is NaN there too.
    nan = alpha * (nan + reference.nan_unless_finite(v, (-2, -1)))
    out = scale * ((q @ k.transpose(-1, -2)) @ coefficients)
    return out + nan[..., None, None] + reference.nan_unless_finite(q, -1)[..., None]


def sigma_intention_dual(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, key_padding_mask: Optional[Tensor],
                         scale: float, op: str = "sigma_intention") -> Tensor:
    """``softmax(scale·(QKᵀ)(KKᵀ + αI)⁻¹) V`` over the valid keys, ``alpha > 0``. Every head it answers has
    a valid key (an empty one is never rank deficient), so no row is all padding."""
    k, v = reference.masked_keys(k, v, key_padding_mask)
    # The scores' transpose (KKᵀ + αI)⁻¹ K Qᵀ: one solve for all query rows (the system is symmetric).
    solved, nan = _solve(k, k @ q.transpose(-1, -2), key_padding_mask, alpha, op)
    scores = scale * solved.transpose(-1, -2)
    scores = scores + (alpha * nan)[..., None, None] + reference.nan_unless_finite(q, -1)[..., None]
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v
