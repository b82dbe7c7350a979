"""``intention`` and ``sigma_intention``: attention as ridge regression from keys to values (docs/spec.md §4)."""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor

from attn_ext.ops.cross_attention.chunked import DEFAULT_CHUNK_SIZE, cross_attention
from attn_ext.ops.intention.per_head import broadcast_per_head
from attn_ext.ops.intention import naive as reference
from attn_ext.ops.utils import dispatch
from attn_ext.ops.utils.dtypes import accumulation_dtype, compute_dtype
from attn_ext.ops.utils.concrete import concrete
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
        never a NaN or minimum-norm result; use ``α > 0`` there.
    key_padding_mask : Tensor, optional
        Bool ``[B, N]``, True = padding (dropped from the regression).
    form : {"auto", "primal", "dual"}
        ``"primal"`` solves the D×D system ``(KᵀK + αI) W = KᵀV``; ``"dual"`` the N×N system
        ``(KKᵀ + αI) Z = V`` and returns ``scale·Q Kᵀ Z`` (equal for α > 0; where α = 0 the
        primal system is solved whatever the form); ``"auto"`` picks the cheaper one (dual only when
        N < D and D is large enough for the D×D system to outweigh the dual form's fixed cost: at
        D ≤ 128 the fused primal kernel is faster at every N).
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
    check_cross_attention_args(q, k, v, key_padding_mask, _scale(scale), None)
    alpha_t = _alpha_tensor(alpha, q)
    if form not in FORMS:
        raise ValueError(f"attn_ext: unknown form {form!r}; choose one of {', '.join(FORMS)}")
    if form == "auto":
        form = "dual" if _dual_is_cheaper(k.shape[2], k.shape[3]) else "primal"
    if form == "dual" and _has_zero(alpha, alpha_t):
        form = "primal"  # the dual identity needs α > 0 (see naive.intention_dual); the primal kernel raises
    name = dispatch.select_backend("intention", backend, q, value_dim=v.shape[-1])
    if form == "primal" and name != "reference":
        return dispatch.entry("intention", name)(q, k, v, key_padding_mask, alpha_t, float(scale))[0]
    fn = reference.intention_dual if form == "dual" else reference.intention_primal
    q_, k_, v_, alpha_ = _upcast(q, k, v, alpha_t)
    return fn(q_, k_, v_, alpha_, key_padding_mask, float(scale)).to(q.dtype)


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
    check_cross_attention_args(q, k, v, key_padding_mask, _scale(scale), None)
    alpha_t = _alpha_tensor(alpha, q)
    name = dispatch.select_backend("sigma_intention", backend, q)
    if name == "cpp":  # fused on the CPU: Q̃ is made per query tile where the attention consumes it
        return dispatch.entry("sigma_intention", name)(q, k, v, key_padding_mask, alpha_t, float(scale),
                                                        DEFAULT_CHUNK_SIZE)[0]
    if name == "cuda":  # the Intention kernel without values (C = I) gives Q̃ with its backward
        q_tilde = dispatch.entry("sigma_intention", name)(q, k, None, key_padding_mask, alpha_t, float(scale))[0]
    else:
        q_, k_, _, alpha_ = _upcast(q, k, v, alpha_t)
        q_tilde = reference.transformed_queries(q_, k_, alpha_, key_padding_mask, float(scale)).to(q.dtype)
    out = cross_attention(q_tilde, k, v, key_padding_mask=key_padding_mask, scale=1.0, backend=name)
    # A NaN row of Q̃ gives a NaN row here whatever the attention backend does with it (the fused
    # CPU op does so itself); the gradient of the term is NaN there too (nan_unless_finite).
    return out + reference.nan_unless_finite(q_tilde, -1)[..., None].to(out.dtype)


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


def _has_zero(alpha: AlphaLike, alpha_t: Tensor) -> bool:
    if isinstance(alpha, Tensor):  # already synchronised once by _alpha_tensor's check
        return alpha_t.device.type != "meta" and bool((concrete(alpha_t) == 0).any())
    return alpha == 0


def _scale(scale) -> float:
    """``scale`` as a float: any finite real scalar (NumPy's too); None is not a default here (it is 1)."""
    if scale is None:
        raise ValueError("attn_ext: scale must be a finite float, got None (Intention's default is 1.0)")
    return check_scale(scale)


def _alpha_tensor(alpha: AlphaLike, q: Tensor) -> Tensor:
    """``alpha`` as a ``[B, H]`` tensor (a broadcast view), validated: finite and ``>= 0``."""
    B, H = q.shape[:2]
    if isinstance(alpha, Tensor):
        expanded = broadcast_per_head("attn_ext", "alpha", alpha, q)
        if alpha.device.type != "meta":
            values = concrete(alpha.detach())
            if bool((~torch.isfinite(values) | (values < 0)).any()):
                raise ValueError(f"attn_ext: alpha must be finite and >= 0, got {values.flatten()[:8].tolist()}")
        return expanded
    if not is_real_scalar(alpha) or not math.isfinite(alpha) or alpha < 0:
        raise ValueError(f"attn_ext: alpha must be a finite float >= 0 or a tensor, got {alpha!r}")
    dtype = accumulation_dtype(q.dtype)
    return torch.full((B, H), float(alpha), dtype=dtype, device=q.device)

