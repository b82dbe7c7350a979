"""References for python_tests/attention/test_torch_opinfo.py: one SDPA call as a dense formula, its ground
truth, the same-precision computations the FlashAttention rule calibrates against, and its rounding floor.

Every formula here is ``out = (softmax(scale · q kᵀ + bias) ∘ drop) v`` with ``bias`` the call's masking
as a float64 additive tensor (-inf where a pair does not take part) and ``drop = keep / (1 - p)`` under
dropout (1 without). A row with no pair taking part gives 0 and zero gradients (docs/sdpa.md).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

F64 = torch.float64


def reduce_to(grad: Tensor, shape: Sequence[int]) -> Tensor:
    """Sum a ``[..., L, S]`` score gradient over the dims a broadcast mask of ``shape`` was expanded along."""
    lead = grad.dim() - len(shape)
    grad = grad.sum(dim=tuple(range(lead))) if lead else grad
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(dim=dims, keepdim=True) if dims else grad


def dense_longdouble(q, k, v, bias, scale, grad_out, keep=None, p=0.0, mask_shape=None):
    """Out and (dq, dk, dv[, dmask]) in x87 extended precision (eps 1.1e-19), rounded to fp64: the ground
    truth for fp64 inputs and under dropout. ``mask_shape``: also the gradient of a float mask of that shape."""
    ld = np.longdouble
    qn, kn, vn, gn = (t.detach().double().numpy().astype(ld) for t in (q, k, v, grad_out))
    scores = np.matmul(qn, np.swapaxes(kn, -1, -2)) * ld(scale) + bias.numpy().astype(ld)
    allowed = ~np.isneginf(scores)
    row_max = np.where(allowed, scores, ld(-np.inf)).max(axis=-1, keepdims=True)
    empty = np.isneginf(row_max)
    e = np.where(allowed, np.exp(scores - np.where(empty, ld(0), row_max)), ld(0))
    probs = e / np.where(empty, ld(1), e.sum(axis=-1, keepdims=True))
    drop = np.ones_like(probs) if keep is None else keep.numpy().astype(ld) / ld(1.0 - p)
    weights = probs * drop
    out = np.matmul(weights, vn)
    dv = np.matmul(np.swapaxes(weights, -1, -2), gn)
    dprobs = np.matmul(gn, np.swapaxes(vn, -1, -2)) * drop
    ds = probs * (dprobs - (probs * dprobs).sum(axis=-1, keepdims=True))
    dq = np.matmul(ds, kn) * ld(scale)
    dk = np.matmul(np.swapaxes(ds, -1, -2), qn) * ld(scale)

    def to(a):
        return torch.from_numpy(np.ascontiguousarray(a).astype(np.float64))

    grads = [to(dq), to(dk), to(dv)]
    if mask_shape is not None:
        grads.append(reduce_to(to(ds), mask_shape))
    return to(out), tuple(grads)


def _probs(scores: Tensor) -> Tensor:
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)
    return torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)


def dense_torch(q, k, v, bias, scale, grad_out, keep=None, p=0.0, mask_shape=None):
    """The formula by torch's autograd in q's dtype: PyTorch's own same-precision computation of a call
    whose keep mask torch cannot draw (its SDPA math path is this composition)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    mask_leaf = bias.to(q.dtype).clone().requires_grad_(True)
    scores = torch.matmul(leaves[0], leaves[1].transpose(-1, -2)) * scale + mask_leaf
    probs = _probs(scores)
    if keep is not None:
        probs = probs * keep.to(probs.dtype) / (1.0 - p)
    out = torch.matmul(probs, leaves[2])
    grads = list(torch.autograd.grad(out, leaves + [mask_leaf], grad_out.to(q.dtype)))
    mask_grad = grads.pop()
    if mask_shape is not None:
        grads.append(reduce_to(torch.where(torch.isneginf(bias), 0.0, mask_grad), mask_shape))
    return out.detach(), tuple(grads)


def rounding_floors(q, k, v, bias, scale, grad_out, keep=None, p=0.0, mask_shape=None) -> Tuple[float, ...]:
    """The rounding every implementation commits, to first order: ``(out, dq, dk, dv[, dmask])`` floors
    (max over elements), with ``u`` the unit roundoff of the accumulation (fp32; fp64 for fp64 inputs).

    - Each score ``s_ij`` is rounded at least once, ``|δs_ij| <= τ_ij = u |s_ij|``: the forward's softmax
      moves its output by ``Σ_j P_ij τ_ij |drop_ij v_j - out_i|``; the backward's probabilities, recomputed
      as ``exp(s_ij - lse_i)`` from the stored lse (docs/spec.md §1), by ``P_ij (τ_ij + |δlse_i|)``.
      make_tensor's samples have scores up to ~300, where this passes the output's own ulp.
    - The backward's ``dS = P (dP - Δ)`` subtracts two dot products, ``dP_ij = dO_i·v_j`` and
      ``Δ_i = dO_i·out_i``, each rounded once, and ``out`` as stored, in the input dtype (half for half
      inputs). Where they cancel (a saturated row: P = 1, out = v) the true ``dq`` is ~0 and this rounding
      is all that is left, whichever order an implementation sums in.
    Both backward terms are the specified algorithm's own: torch's CPU kernel, measured on these samples,
    is up to ~10x (fp32/fp64 dv) and ~30-50x (fp16/bf16 dq, dk) closer to the truth than attn_ext there.
    """
    u = torch.finfo(F64 if q.dtype == F64 else torch.float32).eps / 2
    qa, ka, va, g = (t.detach().double() for t in (q, k, v, grad_out))
    scores = torch.matmul(qa, ka.transpose(-1, -2)) * scale + bias
    probs = _probs(scores)
    tau = u * torch.where(torch.isneginf(scores), 0.0, scores).abs()
    drop = torch.ones_like(probs) if keep is None else keep.double() / (1.0 - p)
    out = torch.matmul(probs * drop, va)
    spread = (drop[..., None] * va[..., None, :, :] - out[..., :, None, :]).abs()  # [..., L, S, Ev]
    floor_out = (probs[..., None] * tau[..., None] * spread).sum(dim=-2)
    # The backward recomputes P_ij = exp(s_ij - lse_i) from the stored, separately rounded lse (spec §1):
    # δP_ij = P_ij (δs_ij - δlse_i), |δlse_i| <= Σ_k P_ik τ_ik + u |lse_i|.
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    lse_rounding = u * torch.where(torch.isneginf(lse), 0.0, lse).abs()
    dprob_bound = probs * (tau + (probs * tau).sum(dim=-1, keepdim=True) + lse_rounding)
    floor_dv = torch.matmul((dprob_bound * drop).transpose(-1, -2), g.abs())
    dp = torch.matmul(g, va.transpose(-1, -2)) * drop
    delta = (g * out).sum(dim=-1, keepdim=True)
    u_out = torch.finfo(q.dtype).eps / 2  # the output is stored in the input dtype, and Δ is read from it
    dot_rounding = u * torch.matmul(g.abs(), va.abs().transpose(-1, -2)) * drop \
        + (u + u_out) * (g * out).abs().sum(dim=-1, keepdim=True)
    floor_ds = dprob_bound * (dp - delta).abs() + probs * dot_rounding
    floor_dq = abs(scale) * torch.matmul(floor_ds, ka.abs())
    floor_dk = abs(scale) * torch.matmul(floor_ds.transpose(-1, -2), qa.abs())
    floors = [floor_out, floor_dq, floor_dk, floor_dv]
    if mask_shape is not None:
        floors.append(reduce_to(floor_ds, mask_shape))
    return tuple(float(f.max()) if f.numel() else 0.0 for f in floors)


def flash_rule_floor_ulps(floor: float, ref: Tensor, dtype: torch.dtype) -> float:
    """``floor`` in the units of assert_within_flash_rule's ``floor_ulps`` (eps(dtype) · max(1, max|ref|)),
    on top of its one ulp."""
    finite = ref[torch.isfinite(ref)]
    ref_max = float(finite.abs().max()) if finite.numel() else 0.0
    return 1.0 + floor / (torch.finfo(dtype).eps * max(1.0, ref_max))


def empty_rows(bias: Tensor, out_shape: Sequence[int]) -> Tensor:
    """Bool ``out_shape[:-1]``: rows with no pair taking part."""
    return torch.isneginf(bias).all(dim=-1).expand(tuple(out_shape[:-1]))


def scale_of(q: Tensor, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
