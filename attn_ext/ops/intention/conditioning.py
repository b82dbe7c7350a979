"""Which system solves a head of Intention: the D×D (primal) or the N×N (dual) one, by conditioning as well as cost.

With ``n`` valid keys the primal matrix ``KᵀK + αI`` has eigenvalues ``σᵢ² + α`` for the ``min(n, D)``
singular values ``σᵢ`` of the keys and, when ``n < D``, ``D − n`` eigenvalues equal to ``α``: ``KᵀK`` is
rank deficient and the condition number is ``(λmax + α)/α``. The dual matrix ``KKᵀ + αI`` (``n × n``
over the valid keys) has only the ``σᵢ² + α``, so for ``n < D`` its condition number is
``(λmax + α)/(σmin² + α)``, never worse; for ``n ≥ D`` the roles swap and the primal is never worse.

What the rank deficiency costs the primal in working precision: the Gram matrix is rounded, by
about ``u·tr(KᵀK)`` (``u`` the unit roundoff, ``2⁻²⁴`` in float32), in every direction, the D − n
directions the keys do not span included, where only ``α`` stands against it. The right-hand side
``KᵀV`` is rounded likewise, so the solve adds a relative error of about ``u·tr(KᵀK)/α``: measured
0.04 to 0.9 times that estimate (float32, D = 16 to 64), 1.5e-3 at α = 1e-3 for D = 32, N = 8
(where the dual gives 2e-7), and below about ``u·tr(KᵀK)`` the Cholesky factorisation even fails.

So a head is solved in the dual (:func:`auto_plan`) when it has fewer valid keys than D, a positive
``α``, and the estimate exceeds :data:`PRIMAL_TRACE_PER_ALPHA` times ``u``, i.e. when
``tr(KᵀK) > PRIMAL_TRACE_PER_ALPHA·α``. Otherwise the primal's extra error is at most about
``PRIMAL_TRACE_PER_ALPHA·u`` (1.5e-5 in float32, 3e-14 in float64) and its fused kernel, the cheaper
one at D ≤ 128, is kept. The estimate costs one pass over the keys (``tr(KᵀK) = Σ‖k‖²``), against
the ``N·D²`` of the Gram matrix itself.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from attn_ext.ops.intention.naive import valid_key_count
from attn_ext.ops.utils.concrete import concrete, tracing
from attn_ext.ops.utils.dtypes import accumulation_dtype

#: The primal form serves a head with fewer valid keys than D only while ``tr(KᵀK) <= 256·α``:
#: its extra relative error, about ``u·tr(KᵀK)/α``, then stays below ``256·u``.
PRIMAL_TRACE_PER_ALPHA = 256.0

#: What a plan is: ``False`` (every head primal), ``True`` (every head dual), or a bool ``[B, H]``
#: tensor (True = dual) when the heads differ or, under ``torch.compile``, when values decide.
Plan = Union[bool, Tensor]


def key_trace(k: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
    """``tr(KᵀK) = Σ‖k‖²`` over the valid keys, ``[B, H]`` in the accumulation dtype (padding never read)."""
    kf = k.to(accumulation_dtype(k.dtype))
    if key_padding_mask is None:
        return (kf * kf).sum((-2, -1))
    squares = (kf * kf).sum(-1)                                              # [B, H, N]
    return torch.where(key_padding_mask[:, None, :], torch.zeros_like(squares), squares).sum(-1)


def rank_deficient(valid_keys: Union[int, Tensor], trace: Tensor, alpha: Tensor, D: int) -> Tensor:
    """Bool ``[B, H]``: fewer valid keys than D, ``α > 0`` and ``tr(KᵀK) > PRIMAL_TRACE_PER_ALPHA·α``, the
    heads the D×D system in working precision cannot answer within its bound. ``valid_keys``
    broadcasts to ``[B, H]`` (an int: the same for every head).

    A NaN trace (a NaN key) compares False and an infinite one True: either way that head is NaN.
    """
    alpha = alpha.detach()
    heads = (alpha > 0) & (trace > PRIMAL_TRACE_PER_ALPHA * alpha.to(trace.dtype))
    if isinstance(valid_keys, int):
        return heads if valid_keys < D else torch.zeros_like(heads)
    return heads & (valid_keys < D)


def may_need_dual(N: int, D: int, key_padding_mask: Optional[Tensor]) -> bool:
    """Whether any head can have fewer valid keys than D, from the shapes alone (no keys: none)."""
    return N > 0 and (N < D or key_padding_mask is not None)


def auto_plan(k: Tensor, key_padding_mask: Optional[Tensor], alpha: Tensor) -> Tuple[Plan, Optional[Tensor]]:
    """``(plan, tr(KᵀK) or None)`` of ``form="auto"``: the heads it solves in the dual (see the module notes).

    Only shapes decide where no head can have fewer valid keys than D; with a padding mask the valid
    counts are read first (one sync), so that a batch with enough keys everywhere costs no trace.
    """
    N, D = k.shape[2], k.shape[3]
    if not may_need_dual(N, D, key_padding_mask):
        return False, None
    if key_padding_mask is None:
        valid = N                                                             # < D here
    else:
        valid = valid_key_count(k, key_padding_mask)
        if not tracing() and valid.device.type != "meta" and not bool((concrete(valid) < D).any()):
            return False, None
    trace = key_trace(k, key_padding_mask)
    return settle(rank_deficient(valid, trace, alpha, D)), trace


def settle(heads: Tensor) -> Plan:
    """A plan from per-head choices: ``False``/``True`` when every head agrees (read on the host, one sync),
    the tensor itself when they differ, and always the tensor while ``torch.compile`` traces."""
    if tracing() or heads.device.type == "meta":
        return heads
    values = concrete(heads)
    if not bool(values.any()):
        return False
    return True if bool(values.all()) else heads


def split_by_plan(plan: Plan, alpha: Tensor, trace: Tensor, primal, dual) -> Tensor:
    """``primal(α)`` or ``dual(α)`` per head, as ``plan`` says; both are evaluated when it is a tensor.

    Each branch then gets, on the heads the other one answers, the stand-in ridge ``tr(KᵀK) + 1``:
    large enough that those heads never fail a factorisation (the primal's small ridge is what
    fails), and detached, so that gradients reach ``α`` only through the branch that answers.
    """
    if plan is False:
        return primal(alpha)
    if plan is True:
        return dual(alpha)
    stand_in = (trace.detach() + 1).to(alpha.dtype)
    out_dual = dual(torch.where(plan, alpha, stand_in))
    out_primal = primal(torch.where(plan, stand_in, alpha))
    return torch.where(plan[..., None, None], out_dual, out_primal)
