"""The map Intention fits, ``w(K, V) = (KᵀK + αI)⁻¹ KᵀV``, as a tensor of its own.

The paper (Garnelo & Czarnecki, §3.1) notes that Intention can output the inferred mapping itself, a
``[D, Dv]`` matrix per batch and head whatever N is, where attention's corresponding object is an
``N × N`` map. Evaluating it at queries is ``q @ w``.

Both functions run the existing Intention ops with identity queries (``I · W = W`` exactly), so the map
has the same kernels, singular-system errors, NaN rules and gradients as :func:`attn_ext.intention`, and
the map from streamed statistics is the one of the one-shot call by construction.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from attn_ext.ops.intention.pinv import pinv_map_from_state
from attn_ext.ops.intention.ridge import AlphaLike, intention
from attn_ext.ops.intention.state import IntentionState, intention_from_state, intention_state
from attn_ext.ops.intention.variant_checks import check_keys, check_state, named
from attn_ext.ops.utils.dtypes import compute_dtype


def intention_map(k: Tensor, v: Tensor, *, alpha: AlphaLike = 1.0, key_padding_mask: Optional[Tensor] = None,
                  pinv: bool = False, atol: Optional[float] = None, rtol: Optional[float] = None,
                  form: str = "auto", backend: Optional[str] = None) -> Tensor:
    """The ridge-regression map ``w = (KᵀK + αI)⁻¹ KᵀV`` from the keys to the values, per batch and head.

    ``attn_ext.intention(q, k, v, alpha=a, scale=s)`` equals ``s · q @ intention_map(k, v, alpha=a)``.

    Parameters
    ----------
    k, v : Tensor
        ``[B, H, N, D]``, ``[B, H, N, Dv]``.
    alpha, key_padding_mask, form, backend
        As in :func:`attn_ext.intention` (a tensor ``alpha`` receives a gradient; ``α = 0`` with a
        singular ``KᵀK`` raises ``RuntimeError`` unless ``pinv``).
    pinv : bool
        Use the Moore–Penrose pseudo-inverse ``pinv(KᵀK + αI) KᵀV`` (minimum-norm least squares),
        which is defined for singular systems; see :func:`attn_ext.pinv_intention` for ``atol`` /
        ``rtol`` (only with ``pinv``). ``form`` and ``backend`` do not apply then (PyTorch code).

    Returns
    -------
    Tensor
        ``[B, H, D, Dv]``, in float32 for float16/bfloat16 inputs (as the statistics), else in the
        inputs' dtype. NaN for a (batch, head) with a NaN/inf valid key or value.

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> k = torch.randn(1, 1, 50, 3, dtype=torch.float64)
    >>> v = k @ torch.tensor([[1.0], [2.0], [-1.0]], dtype=torch.float64)   # an exactly linear map
    >>> ae.intention_map(k, v, alpha=0.0).flatten().round(decimals=6).tolist()
    [1.0, 2.0, -1.0]
    """
    op = "intention_map"
    check_keys(op, k, v, key_padding_mask)
    if not pinv:
        if atol is not None or rtol is not None:
            raise ValueError(f"attn_ext.{op}: atol / rtol are the pseudo-inverse's tolerances; pass pinv=True")
        dtype = compute_dtype(k.dtype)
        k_, v_ = k.to(dtype), v.to(dtype)
        B, H, _, D = k.shape
        eye = torch.eye(D, dtype=dtype, device=k.device).expand(B, H, D, D)
        with named(op, "intention"):
            return intention(eye, k_, v_, alpha=alpha, key_padding_mask=key_padding_mask, form=form, backend=backend)
    if form != "auto" or backend is not None:
        raise ValueError(f"attn_ext.{op}: form / backend select the Cholesky kernels; pinv=True is PyTorch code")
    state = intention_state(k, v, key_padding_mask=key_padding_mask)
    return pinv_map_from_state(op, state, alpha=alpha, atol=atol, rtol=rtol)


def intention_map_from_state(state: IntentionState, *, alpha: AlphaLike = 1.0, pinv: bool = False,
                             atol: Optional[float] = None, rtol: Optional[float] = None) -> Tensor:
    """:func:`intention_map` from streamed statistics (:func:`attn_ext.intention_state`, updated, merged or
    with keys removed): the map of all the keys the state holds, ``[B, H, D, Dv]`` in the state's dtype.

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> k, v = torch.randn(2, 4, 100, 8, dtype=torch.float64), torch.randn(2, 4, 100, 5, dtype=torch.float64)
    >>> st = ae.update_intention_state(ae.intention_state(k[:, :, :60], v[:, :, :60]), k[:, :, 60:], v[:, :, 60:])
    >>> bool(torch.allclose(ae.intention_map_from_state(st, alpha=0.5), ae.intention_map(k, v, alpha=0.5)))
    True
    """
    op = "intention_map_from_state"
    state = check_state(op, state)
    if pinv:
        return pinv_map_from_state(op, state, alpha=alpha, atol=atol, rtol=rtol)
    if atol is not None or rtol is not None:
        raise ValueError(f"attn_ext.{op}: atol / rtol are the pseudo-inverse's tolerances; pass pinv=True")
    B, H, D = state.gram.shape[:3]
    eye = torch.eye(D, dtype=state.gram.dtype, device=state.gram.device).expand(B, H, D, D)
    with named(op, "intention_from_state"):
        return intention_from_state(eye, state, alpha=alpha)
