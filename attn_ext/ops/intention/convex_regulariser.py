"""Intention with the paper's convex regulariser ``Σ = σ(θ)·KᵀK + (1 − σ(θ))·I`` (σ the logistic sigmoid).

The appendix of the Intention paper (Garnelo & Czarnecki; the Normalisation and Anomaly-detection
sections) learns a logit ``θ`` and mixes the Gram matrix with the identity by ``σ(θ)``, so that the
regularisation strength stays in ``(0, 1)`` whatever ``θ`` the optimiser reaches. For ``0 < σ < 1``

    σKᵀK + (1 − σ)I = σ·(KᵀK + α'I),   α' = (1 − σ)/σ = exp(−θ),

so ``Q Σ⁻¹ KᵀV = (1/σ)·Q (KᵀK + α'I)⁻¹ KᵀV = (1 + exp(−θ))·Intention(K, V, Q; α')``: one call of
the fused Intention op with the ridge ``exp(−θ)``, its output times ``1 + exp(−θ)``. Nothing is
approximated. The two ends of the sigmoid:

* ``θ → +∞`` (σ → 1): plain least squares, ``Q (KᵀK)⁻¹ KᵀV``. Where ``exp(−θ)`` rounds to 0 (θ above
  about 104 in float32, 745 in float64) this is what is computed, and a singular ``KᵀK`` raises (use
  :func:`attn_ext.pinv_intention` there). Below that the ridge is positive, however small, and the
  answer is the regularised one: a head with fewer valid keys than D, whose ``KᵀK`` is singular, is
  solved in the dual form by :func:`attn_ext.intention`'s ``form="auto"`` (its ``N × N`` system
  ``KKᵀ + α'I`` is as well conditioned as the keys), where the D×D system would fail or lose
  ``u·tr(KᵀK)/α'`` to rounding. Only repeated or collinear keys with a ridge below the rounding of
  their Gram matrix still fail the factorisation, and raise.
* ``θ → −∞`` (σ → 0): ``Σ → I`` and the output tends to linear attention ``Q KᵀV``. ``θ`` is clamped
  at ``log(tiny)/2`` of the compute dtype (−43.7 in float32, −354 in float64): below it ``σ(θ)·KᵀK``
  is under the rounding of the identity term (for Gram matrices below about ``5e11`` in float32,
  ``1e137`` in float64), so the value is the limit's to working precision; the gradient with
  respect to ``θ`` is 0 there, the true one being of that negligible size. ``θ = −∞`` is allowed
  and gives that value.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor

from attn_ext.ops.intention.ridge import intention
from attn_ext.ops.intention.variant_checks import check_qkv, named, per_head
from attn_ext.ops.utils.concrete import concrete
from attn_ext.ops.utils.dtypes import accumulation_dtype, compute_dtype

ThetaLike = Union[float, Tensor]
_SINGULAR = "attn_ext.intention: KᵀK + αI is singular"


def convex_intention(q: Tensor, k: Tensor, v: Tensor, *, theta: ThetaLike = 0.0,
                     key_padding_mask: Optional[Tensor] = None, form: str = "auto", scale: float = 1.0,
                     backend: Optional[str] = None) -> Tensor:
    """Convex-regularised Intention: ``scale·Q (σ(θ)KᵀK + (1 − σ(θ))I)⁻¹ KᵀV`` per batch and head.

    Parameters
    ----------
    q, k, v, key_padding_mask, form, backend
        As in :func:`attn_ext.intention`.
    theta : float or Tensor
        The logit ``θ`` of the mixing weight ``σ(θ) = 1/(1 + exp(−θ))`` of ``KᵀK`` (the paper's
        trainable parameter, initialised to 0); any real number, ``±inf`` included (see the module
        notes for the two ends). A tensor broadcastable to ``[B, H]`` (e.g. ``[H]``, one logit per
        head) receives a gradient.
    scale : float
        Multiplies the queries. The paper's variance-preserving choice for this form is
        ``0.5·√D`` (:func:`attn_ext.intention_variance_scale` with ``convex=True``).

    Returns
    -------
    Tensor
        ``[B, H, M, Dv]`` in the input dtype (half inputs are computed in float32). NaN rules as
        in :func:`attn_ext.intention`.

    Raises
    ------
    RuntimeError
        ``θ`` so large that ``exp(−θ)`` rounds to 0 (about 104 in float32, 745 in float64) with a
        singular ``KᵀK`` (fewer than D valid keys or collinear ones): least squares has no unique
        answer there. Also a positive ridge below the rounding of ``KᵀK`` for repeated or collinear
        keys (the factorisation fails).

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> q, k, v = (torch.randn(1, 2, n, 4, dtype=torch.float64) for n in (3, 20, 20))
    >>> out = ae.convex_intention(q, k, v, theta=0.0)        # σ = 1/2: ½(KᵀK + I), so twice ridge α = 1
    >>> bool(torch.allclose(out, 2 * ae.intention(q, k, v, alpha=1.0)))
    True
    """
    op = "convex_intention"
    scale = check_qkv(op, q, k, v, key_padding_mask, scale)
    dtype = compute_dtype(q.dtype)
    # Half inputs run in float32: the factor 1 + exp(−θ) reaches 1e19, far beyond float16.
    q_, k_, v_ = q.to(dtype), k.to(dtype), v.to(dtype)
    theta_min = 0.5 * math.log(torch.finfo(accumulation_dtype(dtype)).tiny)
    if isinstance(theta, Tensor):
        theta_t = per_head(op, "theta", theta, q, allow_infinite=True)
        theta_t = theta_t.to(torch.promote_types(theta_t.dtype, accumulation_dtype(dtype)))
        ridge = torch.exp(-theta_t.clamp_min(theta_min))       # α' = (1 − σ)/σ
        out = _call(op, theta_t, q_, k_, v_, ridge, key_padding_mask, form, scale, backend)
        return (out * (1.0 + ridge).to(out.dtype)[..., None, None]).to(q.dtype)   # the factor 1/σ
    per_head(op, "theta", theta, q, allow_infinite=True)           # a real number, not NaN
    ridge_value = math.exp(-max(float(theta), theta_min))
    out = _call(op, theta, q_, k_, v_, ridge_value, key_padding_mask, form, scale * (1.0 + ridge_value), backend)
    return out.to(q.dtype)


def _call(op: str, theta: ThetaLike, q: Tensor, k: Tensor, v: Tensor, ridge, key_padding_mask: Optional[Tensor],
          form: str, scale: float, backend: Optional[str]) -> Tensor:
    """The fused Intention op with ridge ``α' = exp(−θ)``; its singular-system error restated for ``θ``."""
    try:
        with named(op, "intention"):
            return intention(q, k, v, alpha=ridge, key_padding_mask=key_padding_mask, form=form, scale=scale,
                             backend=backend)
    except RuntimeError as err:
        message = str(err)
        prefix = f"attn_ext.{op}: "
        if not message.startswith(prefix + _SINGULAR[len("attn_ext.intention: "):]):
            raise
        shown = theta if not isinstance(theta, Tensor) else concrete(theta.detach()).flatten()[:8].tolist()
        # The ridge as the op held it (a float is rounded to the accumulation dtype).
        held = concrete(ridge.detach()) if isinstance(ridge, Tensor) else torch.tensor(
            ridge, dtype=accumulation_dtype(q.dtype))
        if bool((held == 0).any()):
            why = f"makes 1 − σ(theta) round to 0 in {q.dtype} (plain least squares)"
        else:  # a positive ridge below the rounding of KᵀK: repeated or collinear keys
            why = (f"gives the ridge exp(−theta) = {held.flatten()[:8].tolist()}, below the rounding of KᵀK "
                   "for these (repeated or collinear) keys")
        raise RuntimeError(f"{prefix}theta = {shown} {why}, and {message[len(prefix):]}. For the minimum-norm "
                           "solution use attn_ext.pinv_intention") from err
