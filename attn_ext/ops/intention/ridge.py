"""``intention`` and ``sigma_intention``: attention as ridge regression from keys to values (docs/spec.md §4)."""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from attn_ext.ops.attention import DEFAULT_CHUNK_SIZE, cross_attention
from attn_ext.ops.intention import dual as dual_forms
from attn_ext.ops.intention import naive as reference
from attn_ext.ops.intention.conditioning import Plan, auto_plan, key_trace, settle, split_by_plan
from attn_ext.ops.intention.dual import valid_keys_first
from attn_ext.ops.intention.per_head import broadcast_per_head
from attn_ext.ops.intention.registration import INTENTION, SIGMA_INTENTION
from attn_ext.ops.utils import dispatch
from attn_ext.ops.utils.concrete import check_on_device, concrete, tracing
from attn_ext.ops.utils.dtypes import accumulation_dtype, compute_dtype
from attn_ext.ops.utils.validation import check_cross_attention_args, check_scale, is_real_scalar

FORMS = ("primal", "dual", "auto")
AlphaLike = Union[float, Tensor]


def intention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    alpha: AlphaLike = 1.0,
    key_padding_mask: Optional[Tensor] = None,
    form: str = "auto",
    scale: float = 1.0,
    backend: Optional[str] = None,
) -> Tensor:
    """Intention: the ridge-regression prediction ``scale·Q (KᵀK + αI)⁻¹ KᵀV`` per batch and head.

    The map fitted by least squares (with ridge ``α``) from the keys to the values, evaluated at the
    queries (Garnelo & Czarnecki). Linear in N: the keys enter only through ``KᵀK`` and ``KᵀV``.

    Parameters
    ----------
    q, k, v : Tensor
        ``[B, H, M, D]``, ``[B, H, N, D]``, ``[B, H, N, Dv]`` (SDPA layout); fp16/bf16 are computed in fp32.
    alpha : float or Tensor
        Ridge ``α >= 0`` (any real scalar, NumPy's included); a tensor broadcastable to ``[B, H]``
        (e.g. one learnable value per head, shape ``[H]``) receives a gradient. ``α = 0`` needs
        ``KᵀK`` invertible: at least ``D`` valid keys of full rank. A singular system (fewer valid
        keys than ``D``, or a failed factorisation) raises ``RuntimeError`` on every form and backend,
        never a NaN or minimum-norm result; use ``α > 0`` there. Under ``torch.compile`` the values
        of a tensor ``alpha`` and the singular systems are checked when the compiled graph runs (an
        assert op raising ``RuntimeError`` naming the op, without the (batch, head)).
    key_padding_mask : Tensor, optional
        Bool ``[B, N]``, True = padding (dropped from the regression).
    form : {"auto", "primal", "dual"}
        ``"primal"`` solves the D×D system ``(KᵀK + αI) W = KᵀV``; ``"dual"`` the N×N system
        ``(KKᵀ + αI) Z = V`` and returns ``scale·Q Kᵀ Z`` (equal for α > 0; where α = 0 the
        primal system is solved whatever the form). ``"auto"`` chooses per (batch, head) by
        conditioning as well as cost (:mod:`attn_ext.ops.intention.conditioning`): a head with fewer
        valid keys than D, ``α > 0`` and ``tr(KᵀK) > 256·α`` is solved in the dual on its valid keys
        (there ``KᵀK`` is rank deficient and the D×D system in working precision loses about
        ``u·tr(KᵀK)/α`` relative, ``u`` the unit roundoff); every other head in the cheaper form,
        which is the primal (its fused kernel) unless N < D and D is large enough for the D×D system
        to outweigh the dual form's fixed cost (D ≥ 256). So the error the primal form adds to
        ``"auto"`` stays below about ``256·u`` (1.5e-5 in float32).
    scale : float
        Multiplies the queries (default 1: the exact ridge prediction; the paper's App. 9 uses √D in
        deep stacks).
    backend : {"cpp", "cuda", "triton", "reference", "auto"}, optional
        Kernel of the primal form, chosen as for :func:`attn_ext.cross_attention`: the fused C++
        kernel on CPU (``attn_ext::intention_fwd``: Gram accumulation over valid keys, Cholesky,
        solves, output; backward by one more solve with the saved factor), Triton on CUDA (D ≤ 128,
        Dv ≤ 256: its factor lives in registers; for larger heads the automatic choice moves on to
        the next backend, and a forced ``"triton"`` raises with the reason), the PyTorch reference
        otherwise (``torch.linalg.cholesky_ex`` with an explicit info check). The dual form is
        PyTorch code on every backend (it is for N < D, where the N×N system is the small one).
        Under ``torch.compile`` the choice of ``"auto"`` is made in the graph: where the shapes allow
        a head with fewer valid keys than D (N < D, or a padding mask), both forms run and each head
        takes its own.

    Returns
    -------
    Tensor
        ``[B, H, M, Dv]`` in the input dtype. A NaN or ±inf in a valid key or value makes its whole
        (batch, head) NaN (every output row depends on every key); one in a query row makes that row
        NaN; padding keys are never read. No error is raised for them, and gradients are NaN there.

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> k = torch.randn(1, 1, 50, 3, dtype=torch.float64)
    >>> v = k @ torch.tensor([[1.0], [2.0], [-1.0]], dtype=torch.float64)   # an exactly linear map
    >>> q = torch.eye(3, dtype=torch.float64).view(1, 1, 3, 3)
    >>> ae.intention(q, k, v, alpha=0.0).flatten().round(decimals=6).tolist()   # recovers its weights
    [1.0, 2.0, -1.0]
    """
    check_cross_attention_args(q, k, v, key_padding_mask, _scale(scale), None, op="intention")
    alpha_t = _alpha_tensor(alpha, q)
    if form not in FORMS:
        raise ValueError(f"attn_ext.intention: unknown form {form!r}; choose one of {', '.join(FORMS)}")
    name = dispatch.select_backend(INTENTION, backend, q, value_dim=v.shape[-1])
    scale = float(scale)
    plan, keep, trace = _plan(form, alpha, alpha_t, k, key_padding_mask)

    def primal(a: Tensor) -> Tensor:
        if name != "reference":
            return dispatch.entry(INTENTION, name)(q, k, v, key_padding_mask, a, scale)[0]
        q_, k_, v_, a_ = _upcast(q, k, v, a)
        return reference.intention_primal(q_, k_, v_, a_, key_padding_mask, scale).to(q.dtype)

    def dual(a: Tensor) -> Tensor:
        k_, v_, mask = valid_keys_first(k, v, key_padding_mask, keep)
        q_, k_, v_, a_ = _upcast(q, k_, v_, a)
        return dual_forms.intention_dual(q_, k_, v_, a_, mask, scale).to(q.dtype)

    return split_by_plan(plan, alpha_t, trace, primal, dual)


def sigma_intention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    alpha: AlphaLike = 1.0,
    key_padding_mask: Optional[Tensor] = None,
    scale: float = 1.0,
    backend: Optional[str] = None,
) -> Tensor:
    """σIntention: ``softmax(scale·Q (KᵀK + αI)⁻¹ Kᵀ) V`` per batch and head.

    The softmax attention of the transformed queries ``Q̃ = scale·Q (KᵀK + αI)⁻¹`` over the keys
    (score scale 1), streamed over key chunks, so its memory is linear in N. On the CPU (``cpp``) one
    fused op makes each tile of Q̃ where the attention consumes it; the other backends run the
    Intention kernel without values, then :func:`attn_ext.cross_attention`.

    The heads :func:`intention`'s ``form="auto"`` solves in the dual (fewer valid keys than D and
    ``tr(KᵀK) > 256·α``) take their scores from the dual system instead,
    ``softmax(scale·(QKᵀ)(KKᵀ + αI)⁻¹) V`` over their valid keys: there ``Q̃`` has a component of size
    ``‖Q‖/α`` outside the keys' span, which ``Q̃Kᵀ`` cancels only up to a rounding error of that size.

    Parameters
    ----------
    q, k, v, alpha, key_padding_mask, scale, backend
        As in :func:`intention`, singular systems included. A query row whose keys are all padding
        gets 0. A NaN/inf valid key makes ``Q̃``, and so the output, of its (batch, head) NaN; a
        non-finite query row makes its row NaN; values are as in :func:`attn_ext.cross_attention`.

    Returns
    -------
    Tensor
        ``[B, H, M, Dv]`` in the input dtype.

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 4, 100, 8), torch.randn(2, 4, 100, 5)
    >>> ae.sigma_intention(q, k, v, alpha=0.5).shape
    torch.Size([2, 4, 16, 5])
    """
    check_cross_attention_args(q, k, v, key_padding_mask, _scale(scale), None, op="sigma_intention")
    alpha_t = _alpha_tensor(alpha, q, "sigma_intention")
    name = dispatch.select_backend(SIGMA_INTENTION, backend, q)
    scale = float(scale)
    plan, keep, trace = _plan("auto", alpha, alpha_t, k, key_padding_mask, by_cost=False)

    def primal(a: Tensor) -> Tensor:
        if name == "cpp":  # fused on the CPU: Q̃ is made per query tile where the attention consumes it
            return dispatch.entry(SIGMA_INTENTION, name)(q, k, v, key_padding_mask, a, scale, DEFAULT_CHUNK_SIZE)[0]
        if name == "cuda":  # the Intention kernel without values (C = I) gives Q̃ with its backward
            q_tilde = dispatch.entry(SIGMA_INTENTION, name)(q, k, None, key_padding_mask, a, scale)[0]
        else:
            q_, k_, _, a_ = _upcast(q, k, v, a)
            q_tilde = reference.transformed_queries(q_, k_, a_, key_padding_mask, scale).to(q.dtype)
        out = cross_attention(q_tilde, k, v, key_padding_mask=key_padding_mask, scale=1.0, backend=name)
        # A NaN row of Q̃ gives a NaN row here whatever the attention backend does with it (the fused
        # CPU op does so itself); the gradient of the term is NaN there too (nan_unless_finite).
        return out + reference.nan_unless_finite(q_tilde, -1)[..., None].to(out.dtype)

    def dual(a: Tensor) -> Tensor:
        # Scores from the N×N system: Q̃ itself is never formed (see attn_ext.ops.intention.dual).
        k_, v_, mask = valid_keys_first(k, v, key_padding_mask, keep)
        q_, k_, v_, a_ = _upcast(q, k_, v_, a)
        return dual_forms.sigma_intention_dual(q_, k_, v_, a_, mask, scale).to(q.dtype)

    return split_by_plan(plan, alpha_t, trace, primal, dual)


#: Cost model of ``form="auto"``, in units of one primal flop, fitted on one AMD EPYC thread (B = H = 1,
#: M = N): the fused primal costs about ``D³ + 3·N·D²`` (Cholesky and Gram); the dual, PyTorch code,
#: about ``9·N²·D`` plus a fixed cost of some 0.26 ms (every call), here ``7.5e6``. So the dual form
#: wins only for large heads: at D = 256 with N = 8 (0.33 against 0.48 ms) and at D = 512 with N ≤ 256,
#: not at D ≤ 128 (0.26 ms against 0.02–0.14 ms).
_DUAL_FIXED_COST, _DUAL_PER_N2D = 7.5e6, 9


def _dual_is_cheaper(n: int, d: int) -> bool:
    return n < d and d ** 3 + 3 * n * d * d > _DUAL_PER_N2D * n * n * d + _DUAL_FIXED_COST


def _upcast(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor):
    """fp16/bf16 inputs are solved in fp32 (docs/spec.md §0); ``alpha`` follows the compute dtype."""
    dtype = compute_dtype(q.dtype)
    return q.to(dtype), k.to(dtype), v.to(dtype), alpha.to(dtype)


def _plan(form: str, alpha: AlphaLike, alpha_t: Tensor, k: Tensor, key_padding_mask: Optional[Tensor], *,
          by_cost: bool = True) -> Tuple[Plan, int, Optional[Tensor]]:
    """``(plan, keep, trace)``: which heads the dual solves (:mod:`.conditioning`), on how many keys
    (:func:`~attn_ext.ops.intention.dual.valid_keys_first`), and ``tr(KᵀK)`` where both forms run.

    ``"primal"``: none. ``"dual"`` (or ``"auto"`` where the dual is the cheaper one, ``by_cost``): every
    head with ``α > 0``, on all N keys; with ``α = 0`` the push-through identity does not hold, so
    those heads are solved in the primal, which raises where ``KᵀK`` is singular. ``"auto"``: the
    heads with fewer valid keys than D whose primal system would be too ill-conditioned, on the
    first ``min(N, D − 1)`` keys after the valid ones are moved forward (they have at most D − 1).
    """
    N, D = k.shape[2], k.shape[3]
    zero = not isinstance(alpha, Tensor) and alpha == 0
    if form == "primal" or zero or N == 0:
        return False, N, None
    if form == "dual" or (by_cost and _dual_is_cheaper(N, D)):
        if not isinstance(alpha, Tensor):
            return True, N, None
        plan = settle(alpha_t > 0)
        return plan, N, key_trace(k, key_padding_mask) if isinstance(plan, Tensor) else None
    plan, trace = auto_plan(k, key_padding_mask, alpha_t)
    return plan, min(N, D - 1), trace


def _scale(scale) -> float:
    """``scale`` as a float: any finite real scalar (NumPy's too); None is not a default here (it is 1)."""
    if scale is None:
        raise ValueError("attn_ext: scale must be a finite float, got None (Intention's default is 1.0)")
    return check_scale(scale)


def _alpha_tensor(alpha: AlphaLike, q: Tensor, op: str = "intention") -> Tensor:
    """``alpha`` as a ``[B, H]`` tensor (a broadcast view), validated: finite and ``>= 0``; errors name ``op``.

    Under ``torch.compile`` a tensor's values are checked when the compiled graph runs (an assert op
    raising ``RuntimeError``; in eager mode it is a ``ValueError``).
    """
    B, H = q.shape[:2]
    if isinstance(alpha, Tensor):
        expanded = broadcast_per_head(f"attn_ext.{op}", "alpha", alpha, q)
        if alpha.device.type != "meta":
            if tracing():
                values = alpha.detach()
                check_on_device(torch.isfinite(values) & (values >= 0), f"attn_ext.{op}: alpha must be finite and >= 0")
                return expanded
            values = concrete(alpha.detach())
            if bool((~torch.isfinite(values) | (values < 0)).any()):
                raise ValueError(f"attn_ext.{op}: alpha must be finite and >= 0, got {values.flatten()[:8].tolist()}")
        return expanded
    if not is_real_scalar(alpha) or not math.isfinite(alpha) or alpha < 0:
        raise ValueError(f"attn_ext.{op}: alpha must be a finite float >= 0 or a tensor, got {alpha!r}")
    dtype = accumulation_dtype(q.dtype)
    return torch.full((B, H), float(alpha), dtype=dtype, device=q.device)
