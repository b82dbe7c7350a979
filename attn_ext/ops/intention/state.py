"""Streaming statistics of Intention (docs/spec.md §4): ``G = KᵀK`` and ``C = KᵀV`` add over key chunks.

Conditioning on a context, adding points, merging shards and removing points are all exact sums
and differences of these statistics, in memory independent of N.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from attn_ext.ops.intention import naive as reference
from attn_ext.ops.intention.conditioning import rank_deficient, settle, split_by_plan
from attn_ext.ops.intention.ridge import AlphaLike, _alpha_tensor, _scale
from attn_ext.ops.intention.span import span_solve
from attn_ext.ops.utils.concrete import check_on_device, concrete, tracing
from attn_ext.ops.utils.dtypes import compute_dtype
from attn_ext.ops.utils.validation import check_cross_attention_args


class IntentionState(NamedTuple):
    """Sufficient statistics of the keys and values seen so far, per batch entry and head.

    Attributes
    ----------
    gram : Tensor
        ``[B, H, D, D]``, ``KᵀK`` over the valid keys (fp32 for fp16/bf16 inputs, else their dtype).
    kv : Tensor
        ``[B, H, D, Dv]``, ``KᵀV``.
    count : Tensor
        Long ``[B, H]``, the number of valid keys (the same for every head).
    """

    gram: Tensor
    kv: Tensor
    count: Tensor


def intention_state(k: Tensor, v: Tensor, *, key_padding_mask: Optional[Tensor] = None) -> IntentionState:
    """The statistics of ``k [B, H, N, D]`` and ``v [B, H, N, Dv]`` (padding keys left out).

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> k, v = torch.randn(2, 4, 100, 8), torch.randn(2, 4, 100, 5)
    >>> st = ae.intention_state(k[:, :, :60], v[:, :, :60])
    >>> st = ae.update_intention_state(st, k[:, :, 60:], v[:, :, 60:])
    >>> q = torch.randn(2, 4, 7, 8)
    >>> out = ae.intention_from_state(q, st, alpha=0.5)
    >>> bool(torch.allclose(out, ae.intention(q, k, v, alpha=0.5), atol=1e-4))
    True
    """
    _check_keys(k, v, key_padding_mask)
    dtype = compute_dtype(k.dtype)
    gram, kv = reference.statistics(k.to(dtype), v.to(dtype), key_padding_mask)
    B, H, N = k.shape[:3]
    valid = N if key_padding_mask is None else (~key_padding_mask).sum(dim=1, keepdim=True)
    count = torch.as_tensor(valid, device=k.device).expand(B, H).to(torch.long)
    return IntentionState(gram, kv, count)


def update_intention_state(state: IntentionState, k_new: Tensor, v_new: Tensor, *,
                           key_padding_mask: Optional[Tensor] = None) -> IntentionState:
    """``state`` with the keys ``k_new`` / values ``v_new`` added: O(N_new·D·(D + Dv)), whatever came before."""
    return merge_intention_states(state, intention_state(k_new, v_new, key_padding_mask=key_padding_mask))


def merge_intention_states(a: IntentionState, b: IntentionState) -> IntentionState:
    """The statistics of the union of two disjoint key sets (e.g. shards of a context on two ranks)."""
    _check_compatible(a, b)
    return IntentionState(a.gram + b.gram, a.kv + b.kv, a.count + b.count)


def remove_from_intention_state(state: IntentionState, k_old: Tensor, v_old: Tensor, *,
                                key_padding_mask: Optional[Tensor] = None) -> IntentionState:
    """``state`` with keys that were added before taken out again (exact up to rounding).

    Raises ``ValueError`` if more keys would be removed than the state holds; removing keys that
    were never added is not detectable and gives the statistics of a signed key set.
    """
    removed = intention_state(k_old, v_old, key_padding_mask=key_padding_mask)
    _check_compatible(state, removed)
    if tracing():
        check_on_device(removed.count <= state.count, "attn_ext.remove_from_intention_state: cannot remove more "
                        "keys than the state holds")
    elif bool(concrete(removed.count > state.count).any()):
        raise ValueError(
            f"attn_ext: cannot remove {removed.count[:, 0].tolist()} keys from a state of "
            f"{state.count[:, 0].tolist()} keys (per batch entry)"
        )
    return IntentionState(state.gram - removed.gram, state.kv - removed.kv, state.count - removed.count)


def intention_from_state(q: Tensor, state: IntentionState, *, alpha: AlphaLike = 1.0, scale: float = 1.0) -> Tensor:
    """``scale·Q (G + αI)⁻¹ C`` from the statistics: :func:`attn_ext.intention` of the keys seen so far,
    with its rules for singular systems (``RuntimeError``) and non-finite statistics (NaN heads).

    The statistics have no dual form, so a head of fewer keys than D (``state.count < D``) with
    ``tr(G) > 256·α``, where the Cholesky solve would lose about ``u·tr(G)/α`` to the rounding of ``G``
    and ``C`` (:mod:`attn_ext.ops.intention.conditioning`), is solved by an eigendecomposition of
    ``G + αI`` restricted to its ``count`` largest eigenvalues, the span of the keys
    (:mod:`attn_ext.ops.intention.span`): as accurate as the dual form, at the cost of ``eigh``.
    """
    if not isinstance(state, IntentionState):
        raise TypeError(f"attn_ext: state must be an IntentionState, got {type(state).__name__}")
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise ValueError(f"attn_ext: q must be a 4-D tensor [B, H, M, D], got {getattr(q, 'shape', q)!r}")
    B, H, D = state.gram.shape[0], state.gram.shape[1], state.gram.shape[2]
    if (q.shape[0], q.shape[1], q.shape[3]) != (B, H, D):
        raise ValueError(
            f"attn_ext: q {tuple(q.shape)} does not match the state (gram {tuple(state.gram.shape)}): "
            f"need [B, H, M, D] = [{B}, {H}, M, {D}]"
        )
    scale = _scale(scale)
    alpha_t = _alpha_tensor(alpha, q, "intention_from_state").to(state.gram.dtype)
    weights = weights_from_state(state, alpha_t, "intention_from_state")
    q_ = q.to(weights.dtype)
    return (scale * (q_ @ weights) + reference.nan_unless_finite(q_, -1)[..., None]).to(q.dtype)


def weights_from_state(state: IntentionState, alpha: Tensor, op: str) -> Tensor:
    """``(G + αI)⁻¹ C`` from the statistics, ``alpha [B, H]``: by Cholesky, except on the heads of fewer keys
    than D whose Cholesky solve would be too ill-conditioned (:mod:`.conditioning`), which are solved in the
    span of their keys (:mod:`.span`). Singular systems raise, non-finite statistics give NaN heads."""
    gram, kv = state.gram, state.kv
    nan = reference.nan_unless_finite(gram, (-2, -1)) + reference.nan_unless_finite(kv, (-2, -1))
    trace = gram.diagonal(dim1=-2, dim2=-1).sum(-1)
    plan = settle(rank_deficient(state.count, trace, alpha, gram.shape[-1]))

    def cholesky(a: Tensor) -> Tensor:
        return reference.solve_regularised(gram, a, kv, valid_keys=state.count, nan=nan, op=op)

    def in_span(a: Tensor) -> Tensor:
        eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
        system = torch.where(torch.isnan(nan)[..., None, None], eye, reference.regularised(gram, a))
        return span_solve(system, kv, state.count) + (a * nan)[..., None, None]

    return split_by_plan(plan, alpha, trace, cholesky, in_span)


def _check_keys(k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor]) -> None:
    # The keys' checks are the cross-attention ones with a stand-in query of the keys' shape.
    check_cross_attention_args(k[:, :, :0], k, v, key_padding_mask, None, None, op="intention_state")


def _check_compatible(a: IntentionState, b: IntentionState) -> None:
    for s in (a, b):
        if not isinstance(s, IntentionState):
            raise TypeError(f"attn_ext: expected IntentionState, got {type(s).__name__}")
    if a.gram.shape != b.gram.shape or a.kv.shape != b.kv.shape:
        raise ValueError(
            f"attn_ext: states do not match: gram {tuple(a.gram.shape)} vs {tuple(b.gram.shape)}, "
            f"kv {tuple(a.kv.shape)} vs {tuple(b.kv.shape)}"
        )
    if a.gram.dtype != b.gram.dtype or a.gram.device != b.gram.device:
        raise TypeError(f"attn_ext: states differ in dtype/device: {a.gram.dtype}/{a.gram.device} vs "
                        f"{b.gram.dtype}/{b.gram.device}")
