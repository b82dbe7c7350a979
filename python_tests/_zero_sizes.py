"""The harness of the zero-size property tests (test_zero_sizes*.py): one :class:`Case` per public op,
each dimension of it set to 0 in turn, forward and backward, on every backend that runs here.

A case either computes (its results and input gradients equal the fp64 PyTorch reference of the same
math: empty where a result has a zero dimension, ``0`` / ``lse = −inf`` over no key, ...), or, for the
dimensions the op documents as refused, raises an error that names the op and the reason.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

import pytest
import torch
from torch import Tensor

import attn_ext as ae

F64 = torch.float64
#: Refusal of a zero head dim D by every attention and Intention op (documented in their pages).
REFUSE_D = "head dim D must be positive|positive embedding dim E"


@dataclass(frozen=True)
class Case:
    """``build(sizes, dtype, generator) -> inputs``; ``run(backend, *inputs) -> results``;
    ``reference(*inputs) -> expected results`` (fp64 inputs, differentiable PyTorch);
    ``grad_inputs``: positions of the inputs to differentiate (none: forward only);
    ``refuses``: dimension -> pattern of the documented refusal (naming the op, unless the pattern names
    the op the case calls to build its input)."""

    op: str
    sizes: Mapping[str, int]
    build: Callable[..., Tuple]
    run: Callable[..., Tuple[Tensor, ...]]
    reference: Callable[..., Tuple[Tensor, ...]]
    backends: Tuple[str, ...] = ("default",)
    grad_inputs: Tuple[int, ...] = ()
    refuses: Mapping[str, str] = field(default_factory=dict)
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or self.op


def params(cases: Sequence[Case]):
    """pytest parameters ``(case, dim, backend)`` of every case, dimension and backend."""
    return [pytest.param(c, dim, b, id=f"{c.name}-{dim}=0-{b}") for c in cases for dim in c.sizes for b in c.backends]


def _require(op: str, backend: str, x: Tensor) -> None:
    if backend == "default":
        return
    from attn_ext.ops.utils.dispatch import OPS

    reason = ae.available_backends(x, op if op in OPS else "cross_attention")[backend]  # states: its backends
    if reason is not None:
        pytest.skip(f"backend {backend!r} unavailable: {reason}")


def _as_tuple(results) -> Tuple[Tensor, ...]:
    return tuple(results) if isinstance(results, (tuple, list)) else (results,)


def _assert_same(got: Tensor, expected: Tensor, tol: float, what: str) -> None:
    assert tuple(got.shape) == tuple(expected.shape), \
        f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    torch.testing.assert_close(got.to(F64), expected.to(F64), rtol=tol, atol=tol, equal_nan=False, msg=what)


def check(case: Case, dim: str, backend: str) -> None:
    """The property of the module docstring for ``case`` with ``dim`` = 0 on ``backend``."""
    sizes = dict(case.sizes)
    sizes[dim] = 0
    dtype = torch.float32 if backend == "triton" else F64
    inputs = case.build(sizes, dtype, torch.Generator().manual_seed(0))
    first = next((x for x in inputs if isinstance(x, Tensor) and x.is_floating_point()), None)
    if first is not None:
        _require(case.op, backend, first)
    leaves = [x.detach().clone().requires_grad_() if i in case.grad_inputs else x for i, x in enumerate(inputs)]
    what = f"{case.name} with {dim} = 0 on {backend}"
    if dim in case.refuses:
        with pytest.raises((ValueError, RuntimeError, TypeError)) as error:
            case.run(backend, *leaves)
        message = str(error.value)
        # A pattern that names an op itself is the error of the op the case calls first (its input state).
        named = "attn_ext" in case.refuses[dim] or re.search(rf"attn_ext\.{case.op}\b", message)
        assert named and re.search(case.refuses[dim], message), \
            f"{what}: the error must name the op and the reason, got {message!r}"
        return
    torch.manual_seed(1)  # a random draw in the op (dropout) is the reference's too
    results = _as_tuple(case.run(backend, *leaves))
    ref_leaves = [x.detach().to(F64).requires_grad_() if i in case.grad_inputs else
                  (x.to(F64) if isinstance(x, Tensor) and x.is_floating_point() else x) for i, x in enumerate(inputs)]
    torch.manual_seed(1)
    expected = _as_tuple(case.reference(*ref_leaves))
    assert len(results) == len(expected), what
    tol = 2e-5 if dtype == torch.float32 else 1e-10
    for i, (got, exp) in enumerate(zip(results, expected)):
        _assert_same(got, exp, tol, f"{what}: result {i}")
    if not case.grad_inputs:
        return
    g = torch.Generator().manual_seed(2)
    # Cotangents where the expected result is finite (no gradient flows from an lse of −inf).
    zero = torch.zeros((), dtype=F64)
    cotangents = [torch.where(torch.isfinite(e), torch.randn(e.shape, generator=g, dtype=F64), zero) for e in expected]
    diff = [(r, e, c) for r, e, c in zip(results, expected, cotangents) if r.requires_grad]
    assert diff, f"{what}: no result carries a gradient"
    wrt = [leaves[i] for i in case.grad_inputs]
    ref_wrt = [ref_leaves[i] for i in case.grad_inputs]
    grads = torch.autograd.grad([r for r, _, _ in diff], wrt, [c.to(r.dtype) for r, _, c in diff], allow_unused=True)
    ref_diff = [(e, c) for e, c in zip(expected, cotangents) if e.requires_grad]
    ref_grads = torch.autograd.grad([e for e, _ in ref_diff], ref_wrt, [c for _, c in ref_diff], allow_unused=True) \
        if ref_diff else [None] * len(ref_wrt)
    for i, (got, exp, x) in enumerate(zip(grads, ref_grads, ref_wrt)):
        got = torch.zeros_like(x) if got is None else got
        exp = torch.zeros_like(x) if exp is None else exp
        _assert_same(got, exp, tol, f"{what}: gradient of input {case.grad_inputs[i]}")


# ------------------------------------------------------------------------------------------------
# Inputs and fp64 references
# ------------------------------------------------------------------------------------------------


def randn(generator: torch.Generator, dtype, *shape) -> Tensor:
    return torch.randn(*shape, generator=generator, dtype=F64).to(dtype)


def padding(generator: torch.Generator, B: int, N: int) -> Tensor:
    """``[B, N]`` bool, True = padding: the last key of the first entry, and every key of none."""
    mask = torch.zeros(B, N, dtype=torch.bool)
    if B > 0 and N > 1:
        mask[0, -1] = True
    return mask


def attention(q: Tensor, k: Tensor, v: Tensor, allowed: Optional[Tensor] = None, scale: Optional[float] = None,
              bias: Optional[Tensor] = None, keep: Optional[Tensor] = None, dropout_p: float = 0.0):
    """``(out, lse)`` of softmax attention over the allowed pairs (``allowed`` broadcastable to
    ``[B, H, M, N]``); a row with no pair is ``(0, −inf)`` with zero gradients; GQA by repeating heads."""
    B, H, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if Hkv not in (0, H):
        k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    allowed = torch.ones(scores.shape, dtype=torch.bool) if allowed is None else allowed.expand(scores.shape)
    empty = ~allowed.any(dim=-1)
    safe = torch.where(allowed & ~empty[..., None], scores, torch.zeros_like(scores))
    shift = torch.where(allowed, safe, torch.full_like(safe, -math.inf)).amax(dim=-1).detach() if N > 0 else \
        torch.zeros(scores.shape[:-1], dtype=q.dtype)
    shift = torch.where(empty, torch.zeros_like(shift), shift)
    weights = torch.where(allowed, torch.exp(safe - shift[..., None]), torch.zeros_like(safe))
    total = weights.sum(dim=-1)
    total_safe = torch.where(empty, torch.ones_like(total), total)
    probs = weights / total_safe[..., None]
    if keep is not None:
        probs = probs * keep.to(probs.dtype) / (1.0 - dropout_p)
    lse = torch.where(empty, torch.full_like(total, -math.inf), torch.log(total_safe) + shift)
    return torch.matmul(probs, v), lse


def key_allowed(key_padding_mask: Optional[Tensor]) -> Optional[Tensor]:
    """``[B, 1, 1, N]`` pairs allowed by a key padding mask (True = padding)."""
    return None if key_padding_mask is None else ~key_padding_mask[:, None, None, :]


def ridge_weights(k: Tensor, v: Tensor, alpha: float, key_padding_mask: Optional[Tensor]) -> Tensor:
    """``(KᵀK + αI)⁻¹ KᵀV`` over the valid keys, ``[B, H, D, Dv]``."""
    if key_padding_mask is not None:
        keep = ~key_padding_mask[:, None, :, None]
        k, v = torch.where(keep, k, torch.zeros_like(k)), torch.where(keep, v, torch.zeros_like(v))
    kt = k.transpose(-1, -2)
    eye = torch.eye(k.shape[-1], dtype=k.dtype)
    return torch.linalg.solve(kt @ k + alpha * eye, kt @ v)


def ridge_queries(q: Tensor, k: Tensor, alpha: float, key_padding_mask: Optional[Tensor], scale: float) -> Tensor:
    """σIntention's transformed queries ``scale·Q (KᵀK + αI)⁻¹``."""
    if key_padding_mask is not None:
        k = torch.where(~key_padding_mask[:, None, :, None], k, torch.zeros_like(k))
    gram = k.transpose(-1, -2) @ k + alpha * torch.eye(k.shape[-1], dtype=k.dtype)
    return scale * torch.linalg.solve(gram, q.transpose(-1, -2)).transpose(-1, -2)


def spd(generator: torch.Generator, dtype, B: int, n: int) -> Tensor:
    """``[B, n, n]`` well-conditioned symmetric positive definite matrices."""
    a = randn(generator, F64, B, n, n)
    return (a @ a.transpose(-1, -2) + n * torch.eye(n, dtype=F64)).to(dtype)
