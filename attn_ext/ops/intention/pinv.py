"""Intention with the Moore–Penrose pseudo-inverse: ``Q pinv(KᵀK + αI) KᵀV``, defined for singular systems.

The paper (Garnelo & Czarnecki, §3.1) suggests the pseudo-inverse where ``Σ = KᵀK + αI`` may not be
invertible. With ``α = 0`` the map ``pinv(KᵀK) KᵀV = pinv(K) V`` is the minimum-norm least-squares
solution: for fewer keys than dimensions (N < D) it interpolates the values with the smallest map, and
for collinear keys it spreads the weight evenly over the duplicated directions. Where ``KᵀK + αI`` is
invertible the answer is the regular solve's.

It is computed from the streaming statistics (:class:`attn_ext.IntentionState`), so streaming, merging
and removing keys give the map of the one-shot call, as :func:`torch.linalg.pinv` with ``hermitian=True``
computes it (an eigendecomposition of the D×D system, differentiable where the rank does not change),
except that a state of ``n < D`` keys keeps only its ``n`` largest eigenvalues (:mod:`.span`): the
others are ``α`` exactly and add nothing, but in working precision they carry the rounding of
``KᵀK`` and ``KᵀV``, which ``1/α`` would amplify (relative errors of 1e-2 in float32 for ``α = 1e-3``,
D = 32, n = 8, where the tolerance keeps them).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from attn_ext.ops.intention import naive as reference
from attn_ext.ops.intention.ridge import AlphaLike, _alpha_tensor, _scale
from attn_ext.ops.intention.span import span_solve
from attn_ext.ops.intention.state import IntentionState, intention_state
from attn_ext.ops.intention.variant_checks import (
    check_qkv,
    check_state,
    check_state_query,
    named,
    non_negative_float,
)


def pinv_intention(q: Tensor, k: Tensor, v: Tensor, *, alpha: AlphaLike = 0.0,
                   key_padding_mask: Optional[Tensor] = None, atol: Optional[float] = None,
                   rtol: Optional[float] = None, scale: float = 1.0) -> Tensor:
    """Intention with the pseudo-inverse: ``scale·Q pinv(KᵀK + αI) KᵀV`` per batch and head.

    Parameters
    ----------
    q, k, v, key_padding_mask, scale
        As in :func:`attn_ext.intention`.
    alpha : float or Tensor
        Ridge ``α >= 0``, default 0 (plain least squares). A tensor broadcastable to ``[B, H]``
        receives a gradient. For ``α > 0`` the system is invertible and this is
        :func:`attn_ext.intention` up to rounding (unless the tolerance cuts an eigenvalue).
    atol, rtol : float, optional
        The rank tolerance of :func:`torch.linalg.pinv`, applied to the eigenvalues ``λ`` of
        ``KᵀK + αI`` (the squared singular values of the keys when ``α = 0``): eigenvalues below
        ``max(atol, rtol·λ_max)`` are treated as zero. Defaults as there: ``rtol = D·eps`` of the
        compute dtype when neither is given, ``rtol = 0`` when only ``atol > 0`` is. A key direction
        whose singular value is below ``√rtol`` times the largest is dropped (about ``2e-7`` in
        float64 and ``4e-3`` in float32 for ``D = 128``). With ``n < D`` valid keys only the ``n``
        largest eigenvalues are candidates: the other ``D − n`` belong to directions no key spans.

    Returns
    -------
    Tensor
        ``[B, H, M, Dv]`` in the input dtype (computed in float32 for half inputs). NaN for a
        (batch, head) with a NaN/inf valid key or value and for a NaN/inf query row, as in
        :func:`attn_ext.intention`; never an error for a singular system.

    Notes
    -----
    The gradient is that of :func:`torch.linalg.pinv`: the derivative at a fixed rank, so it does not
    see a perturbation that would lift a zero eigenvalue above the tolerance.

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> k = torch.tensor([[[[1.0, 1.0]]]], dtype=torch.float64)     # one key in two dimensions
    >>> v = torch.tensor([[[[2.0]]]], dtype=torch.float64)
    >>> q = torch.eye(2, dtype=torch.float64).view(1, 1, 2, 2)
    >>> ae.pinv_intention(q, k, v).flatten().round(decimals=12).tolist()   # the minimum-norm map
    [1.0, 1.0]
    """
    op = "pinv_intention"
    scale = check_qkv(op, q, k, v, key_padding_mask, scale)
    state = intention_state(k, v, key_padding_mask=key_padding_mask)
    weights = pinv_map_from_state(op, state, alpha=alpha, atol=atol, rtol=rtol)
    return _apply(q, weights, scale)


def pinv_intention_from_state(q: Tensor, state: IntentionState, *, alpha: AlphaLike = 0.0,
                              atol: Optional[float] = None, rtol: Optional[float] = None,
                              scale: float = 1.0) -> Tensor:
    """:func:`pinv_intention` of the keys and values a streamed :class:`attn_ext.IntentionState` holds.

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> k, v = torch.randn(1, 2, 5, 8, dtype=torch.float64), torch.randn(1, 2, 5, 3, dtype=torch.float64)
    >>> q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    >>> st = ae.update_intention_state(ae.intention_state(k[:, :, :2], v[:, :, :2]), k[:, :, 2:], v[:, :, 2:])
    >>> bool(torch.allclose(ae.pinv_intention_from_state(q, st), ae.pinv_intention(q, k, v)))
    True
    """
    op = "pinv_intention_from_state"
    state = check_state(op, state)
    check_state_query(op, q, state)
    with named(op):
        scale = _scale(scale)
    weights = pinv_map_from_state(op, state, alpha=alpha, atol=atol, rtol=rtol)
    return _apply(q, weights, scale)


def pinv_map_from_state(op: str, state: IntentionState, *, alpha: AlphaLike, atol: Optional[float],
                        rtol: Optional[float]) -> Tensor:
    """``pinv(G + αI) C`` from the statistics, ``[B, H, D, Dv]`` in their dtype; ``op`` names the caller."""
    atol = non_negative_float(op, "atol", atol, allow_none=True)
    rtol = non_negative_float(op, "rtol", rtol, allow_none=True)
    gram, kv = state.gram, state.kv
    alpha_t = _alpha_tensor(alpha, gram, op).to(gram.dtype)
    # A head with non-finite statistics gets the identity as its system (so that the eigensolver
    # neither fails nor raises) and then NaN, as in attn_ext.intention.
    nan = reference.nan_unless_finite(gram, (-2, -1)) + reference.nan_unless_finite(kv, (-2, -1))
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    system = torch.where(torch.isnan(nan)[..., None, None], eye, reference.regularised(gram, alpha_t))
    # torch.linalg.pinv(system, atol, rtol, hermitian=True) applied to kv, except that the eigenvalues a
    # state of fewer keys than D cannot have (its KᵀK has rank <= count) are dropped whatever their rounding.
    weights = span_solve(system, kv, state.count, atol=0.0 if atol is None else atol, rtol=rtol)
    # α·nan: NaN exactly on the non-finite heads, and α's gradient is NaN there too.
    return weights + (alpha_t * nan)[..., None, None]


def _apply(q: Tensor, weights: Tensor, scale: float) -> Tensor:
    """``scale·q @ w`` in the map's dtype, a NaN row for a non-finite query row, back in ``q``'s dtype."""
    q_ = q.to(weights.dtype)
    return (scale * (q_ @ weights) + reference.nan_unless_finite(q_, -1)[..., None]).to(q.dtype)
