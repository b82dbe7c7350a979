"""Shared helpers of the attn_ext test suite: naive attention, the FlashAttention error rule, inputs.

``naive_attention`` is the textbook full-matrix computation. Run on ``.double()`` inputs it is the
fp64 ground truth; run on the inputs as they are it is "PyTorch's own computation in the same
precision", whose error against the ground truth calibrates what error a kernel may have
(the rule of the FlashAttention test suite, see :func:`assert_within_flash_rule`).
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Sequence, Tuple

import numpy as np
import pytest
import torch
from torch import Tensor

import attn_ext as ae

ALL_BACKENDS = ("cpp", "reference", "triton")


def require_backend(name: str, q: Tensor) -> None:
    """Skip the calling test, with the library's own reason, if backend ``name`` cannot run ``q``."""
    reason = ae.available_backends(q)[name]
    if reason is not None:
        pytest.skip(f"backend {name!r} unavailable: {reason}")


# ----------------------------------------------------------------------------------------------
# Naive attention (ground truth and same-precision PyTorch computation)
# ----------------------------------------------------------------------------------------------


def naive_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None, scale: Optional[float] = None
) -> Tuple[Tensor, Tensor]:
    """Full-matrix attention in the dtype of the inputs; returns ``(out, lse)``.

    Rows whose keys are all padded get ``out = 0`` and ``lse = -inf``; the computation is written
    with ``torch.where`` so that autograd gives zero (not NaN) gradients for them, also through lse.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(mask[:, None, None, :], -math.inf)
    empty = torch.isinf(scores).all(dim=-1) if scores.shape[-1] > 0 else torch.ones(
        scores.shape[:-1], dtype=torch.bool, device=scores.device
    )
    safe_scores = torch.where(empty[..., None], torch.zeros_like(scores), scores)
    lse_safe = torch.logsumexp(safe_scores, dim=-1)
    lse = torch.where(empty, torch.full_like(lse_safe, -math.inf), lse_safe)
    probs = torch.where(empty[..., None], torch.zeros_like(scores), torch.exp(safe_scores - lse_safe[..., None]))
    out = torch.matmul(probs, v)
    return out, lse


def naive_attention_longdouble(q, k, v, mask=None, scale=None) -> Tuple[Tensor, Tensor]:
    """Forward of :func:`naive_attention` in numpy's x87 extended precision (eps 1.1e-19), rounded to
    fp64: the ground truth for fp64 inputs, whose same-precision computation *is* the fp64 naive one."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    ld = np.longdouble
    qn, kn, vn = (t.detach().double().cpu().numpy().astype(ld) for t in (q, k, v))
    scores = np.matmul(qn, np.swapaxes(kn, -1, -2)) * ld(scale)
    if mask is not None:
        scores = np.where(mask.cpu().numpy()[:, None, None, :], ld(-np.inf), scores)
    row_max = scores.max(axis=-1, keepdims=True) if scores.shape[-1] else np.full(scores.shape[:-1] + (1,), -np.inf)
    empty = np.isinf(row_max)
    shift = np.where(empty, ld(0), row_max)
    weights = np.exp(scores - shift)
    total = weights.sum(axis=-1, keepdims=True)
    safe_total = np.where(empty, ld(1), total)
    out = np.where(empty, ld(0), np.matmul(weights, vn) / safe_total)
    lse = np.where(empty, ld(-np.inf), shift + np.log(safe_total))[..., 0]
    return torch.from_numpy(out.astype(np.float64)), torch.from_numpy(lse.astype(np.float64))


def naive_reference_and_same_precision(q, k, v, mask=None, scale=None):
    """``((out_ref, lse_ref), (out_pt, lse_pt))``: the ground truth (fp64; extended precision for fp64
    inputs) and the same computation by PyTorch in the inputs' precision."""
    if q.dtype == torch.float64:
        ref = naive_attention_longdouble(q, k, v, mask, scale)
    else:
        ref = naive_attention(q.double(), k.double(), v.double(), mask, scale)
    same = naive_attention(q, k, v, mask, scale)
    return ref, same


def naive_grads(q, k, v, mask, scale, grad_out, grad_lse, *, dtype: Optional[torch.dtype] = None):
    """Gradients of q, k, v of ``<out, grad_out> + <lse, grad_lse>`` through :func:`naive_attention`,
    computed in ``dtype`` (default: the inputs' dtype)."""
    dtype = q.dtype if dtype is None else dtype
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    out, lse = naive_attention(*leaves, mask, scale)
    grads = torch.autograd.grad((out, lse), leaves, (grad_out.to(out.dtype), grad_lse.to(lse.dtype)))
    return tuple(grads)


# ----------------------------------------------------------------------------------------------
# The FlashAttention error rule
# ----------------------------------------------------------------------------------------------


def _max_abs_err(a: Tensor, ref: Tensor, finite: Tensor) -> float:
    if not bool(finite.any()):
        return 0.0
    return float((a.detach().double()[finite] - ref.detach()[finite]).abs().max())


def assert_within_flash_rule(
    ours: Tensor, ref64: Tensor, pytorch_same_precision: Tensor, *, grad: bool = False, name: str = "",
    floor_ulps: float = 1.0,
) -> None:
    """FlashAttention's accuracy rule.

    ``max|ours − ref| ≤ factor · max|pt − ref| + floor`` with factor 2 (3 for gradients),
    ``floor = eps(ours.dtype) · max(1, max|ref|)``; ``ref`` is the fp64 ground truth, ``pt`` the same
    computation done by PyTorch in the inputs' precision. Also: no NaN in ``ours``, same shape, and
    infinite entries of ``ref`` (lse of fully padded rows) must be matched exactly.
    """
    label = name or "tensor"
    assert ours.shape == ref64.shape, f"{label}: shape {tuple(ours.shape)} != expected {tuple(ref64.shape)}"
    assert not bool(torch.isnan(ours).any()), f"{label}: NaN in result ({int(torch.isnan(ours).sum())} entries)"
    ref64 = ref64.double()
    finite = torch.isfinite(ref64)
    if not bool(finite.all()):
        inf_ref = ref64[~finite]
        inf_ours = ours.double()[~finite]
        assert torch.equal(inf_ours, inf_ref), f"{label}: infinite expected entries not matched: got {inf_ours[:8]}"
    assert bool(torch.isfinite(ours.double()[finite]).all()), f"{label}: non-finite value where finite expected"
    err_ours = _max_abs_err(ours, ref64, finite)
    err_pt = _max_abs_err(pytorch_same_precision, ref64, finite)
    ref_max = float(ref64[finite].abs().max()) if bool(finite.any()) else 0.0
    floor = floor_ulps * torch.finfo(ours.dtype).eps * max(1.0, ref_max)
    factor = 3.0 if grad else 2.0
    bound = factor * err_pt + floor
    assert err_ours <= bound, (
        f"{label}: max|ours - ref| = {err_ours:.3e} exceeds {factor:g} * max|pytorch - ref| "
        f"({err_pt:.3e}) + floor {floor:.3e} = {bound:.3e} (dtype {ours.dtype}, max|ref| = {ref_max:.3e})"
    )


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


def make_qkv(
    B: int, H: int, M: int, N: int, D: int, Dv: Optional[int] = None, dtype=torch.float32, *,
    layout: str = "contiguous", seed: int = 0,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Random q, k, v (standard normal, then rounded to ``dtype``) in one of several memory layouts.

    ``layout``: ``contiguous``; ``transposed`` (views of ``[B, L, H, D]`` tensors, as from a
    projection); ``padded_rows`` (slice ``[..., :D]`` of a wider last dim: unit stride, row stride
    > D); ``strided_last`` (``[..., ::2]``: last-dim stride 2); ``broadcast`` (batch expanded from 1,
    stride 0).
    """
    Dv = D if Dv is None else Dv
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    def rand(L: int, d: int) -> Tensor:
        if layout == "contiguous":
            return randn(B, H, L, d)
        if layout == "transposed":
            return randn(B, L, H, d).transpose(1, 2)
        if layout == "padded_rows":
            return randn(B, H, L, d + 5)[..., :d]
        if layout == "strided_last":
            return randn(B, H, L, 2 * d)[..., ::2]
        if layout == "broadcast":
            return randn(1, H, L, d).expand(B, H, L, d)
        raise ValueError(layout)

    q, k, v = rand(M, D), rand(N, D), rand(N, Dv)
    if layout not in ("contiguous", "broadcast") and max(M, N) > 1:
        assert not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous())
    return q, k, v


def make_mask(kind: str, B: int, N: int, seed: int = 1) -> Optional[Tensor]:
    """Key padding masks (True = padding). Every kind except ``none`` has padding somewhere.

    ``random``: about 30 % padded, each batch entry keeping at least one key; ``lengths``: a
    valid prefix per entry (varying context sizes, as in Neural Processes); ``all_padded``: like
    ``random`` but batch entry 0 is fully padded; ``all_but_last``: only the last key is valid.
    """
    if kind == "none":
        return None
    gen = torch.Generator().manual_seed(seed)
    if kind in ("random", "all_padded"):
        mask = torch.rand(B, N, generator=gen) < 0.3
        mask[:, torch.randint(N, (1,), generator=gen)] = False
        if kind == "all_padded":
            mask[0] = True
        return mask
    if kind == "lengths":
        lengths = torch.randint(1, N + 1, (B,), generator=gen)
        lengths[-1] = N
        return torch.arange(N)[None, :] >= lengths[:, None]
    if kind == "all_but_last":
        mask = torch.ones(B, N, dtype=torch.bool)
        mask[:, -1] = False
        return mask
    raise ValueError(kind)


def fully_padded_entries(mask: Optional[Tensor]) -> Sequence[int]:
    """Batch indices whose keys are all padding."""
    if mask is None:
        return []
    return [int(b) for b in torch.nonzero(mask.all(dim=1)).flatten()]


def run_backend(backend: str, q, k, v, mask=None, scale=None, chunk_size=None):
    """``(out, lse)`` of ``ae.cross_attention`` on ``backend``; skips if it cannot run."""
    require_backend(backend, q)
    return ae.cross_attention(
        q, k, v, key_padding_mask=mask, scale=scale, chunk_size=chunk_size, return_lse=True, backend=backend
    )


@functools.lru_cache(maxsize=6)
def forward_case(
    B: int, H: int, M: int, N: int, D: int, Dv: Optional[int] = None, dtype=torch.float32, *,
    layout: str = "contiguous", mask_kind: str = "none", scale: Optional[float] = None, seed: int = 0,
):
    """Inputs and their ground truth / same-precision results, cached so that the backends of one
    parametrized grid (backend varying fastest) share the expensive naive computations.
    Returns ``(q, k, v, mask, scale, refs)``; treat the tensors as read-only."""
    q, k, v = make_qkv(B, H, M, N, D, Dv, dtype, layout=layout, seed=seed)
    mask = make_mask(mask_kind, B, N, seed=seed + 1)
    refs = naive_reference_and_same_precision(q, k, v, mask, scale)
    return q, k, v, mask, scale, refs


def check_forward(backend: str, q, k, v, mask=None, scale=None, chunk_size=None, *, name: str = "", refs=None):
    """Run ``backend`` and check out and lse against the ground truth with the FlashAttention rule."""
    out, lse = run_backend(backend, q, k, v, mask, scale, chunk_size)
    if refs is None:
        refs = naive_reference_and_same_precision(q, k, v, mask, scale)
    (out64, lse64), (out_pt, lse_pt) = refs
    B, H, M, _ = q.shape
    assert out.dtype == q.dtype and out.shape == (B, H, M, v.shape[-1])
    expected_lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    assert lse.dtype == expected_lse_dtype and lse.shape == (B, H, M)
    assert_within_flash_rule(out, out64, out_pt, name=f"{name} out")
    assert_within_flash_rule(lse, lse64, lse_pt, name=f"{name} lse")
    for b in fully_padded_entries(mask):
        assert bool((out[b] == 0).all()), f"{name}: fully padded batch entry {b} has nonzero out"
        assert bool((lse[b] == -math.inf).all()), f"{name}: fully padded batch entry {b} has lse != -inf"
    return out, lse


def check_forward_case(backend: str, case, chunk_size=None, *, name: str = ""):
    q, k, v, mask, scale, refs = case
    return check_forward(backend, q, k, v, mask, scale, chunk_size, name=name, refs=refs)


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=6)
def backward_case(
    B: int, H: int, M: int, N: int, D: int, Dv: Optional[int] = None, dtype=torch.float32, *,
    layout: str = "contiguous", mask_kind: str = "none", scale: Optional[float] = None, seed: int = 0,
):
    """Inputs, random upstream gradients of out and lse, and the gradients of q, k, v by fp64
    autograd (ground truth) and by autograd in the inputs' dtype, cached like :func:`forward_case`.
    Returns ``(q, k, v, mask, scale, grad_out, grad_lse, ref_grads, pt_grads)``."""
    q, k, v = make_qkv(B, H, M, N, D, Dv, dtype, layout=layout, seed=seed)
    mask = make_mask(mask_kind, B, N, seed=seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)
    grad_out = torch.randn(B, H, M, v.shape[-1], generator=gen).to(dtype)
    grad_lse = torch.randn(B, H, M, generator=gen).to(torch.float64 if dtype == torch.float64 else torch.float32)
    ref = naive_grads(q, k, v, mask, scale, grad_out, grad_lse, dtype=torch.float64)
    pt_autograd = naive_grads(q, k, v, mask, scale, grad_out, grad_lse)
    pt_formula = spec_backward_formula(q, k, v, mask, scale, grad_out, grad_lse)
    pt = tuple(worse_of(a, b, r) for a, b, r in zip(pt_autograd, pt_formula, ref))
    return q, k, v, mask, scale, grad_out, grad_lse, ref, pt


def spec_backward_formula(q, k, v, mask, scale, grad_out, grad_lse):
    """The docs/spec.md §1 (FlashAttention) backward written as full-matrix PyTorch in the inputs' dtype:
    ``dS = P (dO vᵀ − Δ + dlse)`` with ``Δ = rowsum(dO ∘ O)``.

    Its ``dO·v_j − Δ`` cancels in floating point even where softmax's autograd cancels exactly
    (a row with a single valid key: P = 1, O = v), an error of a few ulp intrinsic to the specified
    algorithm. The gradient rule therefore calibrates against the worse of this and autograd.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = naive_attention(q, k, v, mask, scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(mask[:, None, None, :], -math.inf)
    empty = torch.isinf(lse)[..., None]
    lse_safe = torch.where(empty[..., 0], torch.zeros_like(lse), lse)
    probs = torch.where(empty, torch.zeros_like(scores), torch.exp(scores - lse_safe[..., None]))
    delta = (grad_out * out).sum(dim=-1)
    grad_scores = probs * (torch.matmul(grad_out, v.transpose(-1, -2)) - delta[..., None]
                           + grad_lse.to(q.dtype)[..., None])
    dq = torch.matmul(grad_scores, k) * scale
    dk = torch.matmul(grad_scores.transpose(-1, -2), q) * scale
    dv = torch.matmul(probs.transpose(-1, -2), grad_out)
    return dq, dk, dv


def worse_of(a: Tensor, b: Tensor, ref: Tensor) -> Tensor:
    finite = torch.isfinite(ref)
    return a if _max_abs_err(a, ref, finite) >= _max_abs_err(b, ref, finite) else b


def backend_grads(backend: str, q, k, v, mask, scale, chunk_size, grad_out, grad_lse):
    """Gradients of q, k, v through ``ae.cross_attention(..., return_lse=True)`` on ``backend``."""
    require_backend(backend, q)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out, lse = ae.cross_attention(
        *leaves, key_padding_mask=mask, scale=scale, chunk_size=chunk_size, return_lse=True, backend=backend
    )
    return torch.autograd.grad((out, lse), leaves, (grad_out, grad_lse))


def check_backward_case(backend: str, case, chunk_size=None, *, name: str = ""):
    """Gradients of ``backend`` vs fp64 autograd with the 3x FlashAttention rule; exact zeros for
    fully padded batch entries and for padded keys."""
    q, k, v, mask, scale, grad_out, grad_lse, ref, pt = case
    grads = backend_grads(backend, q, k, v, mask, scale, chunk_size, grad_out, grad_lse)
    for label, g, leaf, g64, gpt in zip(("dq", "dk", "dv"), grads, (q, k, v), ref, pt):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape, f"{name} {label}: {g.dtype} {tuple(g.shape)}"
        assert_within_flash_rule(g, g64, gpt, grad=True, name=f"{name} {label}")
    if mask is not None:
        dq, dk, dv = grads
        for b in fully_padded_entries(mask):
            assert bool((dq[b] == 0).all()), f"{name}: dq of fully padded batch entry {b} is not 0"
        padded = mask[:, None, :, None].expand(-1, k.shape[1], -1, 1)
        assert bool((dk.masked_select(padded) == 0).all()), f"{name}: dk of padded keys is not 0"
        assert bool((dv.masked_select(padded) == 0).all()), f"{name}: dv of padded keys is not 0"
    return grads


def peak_allocated_bytes(run) -> int:
    """Peak bytes of CPU tensor memory live during ``run()`` beyond what was live before (torch.profiler's
    allocation events, replayed in time order: allocations positive, frees negative)."""
    from torch._C._profiler import _EventType

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = run()
    del out
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    sizes = []
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.tag == _EventType.Allocation:
            sizes.append((event.start_time_ns, event.extra_fields.alloc_size))
    live = peak = 0
    for _, size in sorted(sizes):
        live += size
        peak = max(peak, live)
    return peak
