"""Custom ops of the Intention family: the Python backends' schemas, fake kernels, autograd, and the
backends each public op has (the dispatch table of :mod:`attn_ext.ops.utils.dispatch`).

**Intention** (docs/spec.md §0, §4).

``attn_ext::intention_fwd`` (C++, csrc/cpu/intention.cpp; schema in csrc/schemas.cpp) returns
``(out, factor, weights)``: the output, the Cholesky factor ``L`` of ``KᵀK + αI`` and
``W = (KᵀK + αI)⁻¹KᵀV``, both kept for ``attn_ext::intention_bwd``, which needs one more solve with
``L`` and no inverse. ``factor`` and ``weights`` are intermediates the public functions never return: the fused backward
ignores gradients reaching them, so such gradients (and higher derivatives) go through
:mod:`.composite`. ``..._fwd_triton`` / ``..._bwd_triton`` are the
same contract on the Triton kernels (:mod:`.triton_ridge`, :mod:`.triton_solve`), defined here.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from attn_ext.ops.intention import composite
from attn_ext.ops.intention.cholesky import _check_matrix_and_rhs, _check_square
from attn_ext.ops.utils.autograd import Derivatives, register_derivatives, register_not_differentiable
from attn_ext.ops.utils.dispatch import Implementation, declare
from attn_ext.ops.utils.dtypes import accumulation_dtype
from attn_ext.ops.utils.extension import extension_error
from attn_ext.ops.utils.registration import define_op, register_op_pair


@define_op("attn_ext::intention_fwd_triton")
def _intention_fwd_triton(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], alpha: Tensor,
                          scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    from attn_ext.ops.intention.triton_ridge import intention_fwd_triton

    return intention_fwd_triton(q, k, v, key_padding_mask, alpha, scale)


@define_op("attn_ext::intention_bwd_triton")
def _intention_bwd_triton(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor],
                          factor: Tensor, weights: Tensor, scale: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    from attn_ext.ops.intention.triton_ridge import intention_bwd_triton

    return intention_bwd_triton(grad_out, q, k, v, key_padding_mask, factor, weights, scale)


def _fake_forward(q, k, v, key_padding_mask, alpha, scale):
    B, H, M, D = q.shape
    Dv = D if v is None else v.shape[-1]  # no values: C = I, the transformed queries
    acc = accumulation_dtype(q.dtype)
    return q.new_empty((B, H, M, Dv)), q.new_empty((B, H, D, D), dtype=acc), q.new_empty((B, H, D, Dv), dtype=acc)


def _fake_backward(grad_out, q, k, v, key_padding_mask, factor, weights, scale):
    B, H = q.shape[:2]
    grad_v = q.new_empty((0,)) if v is None else v.new_empty(v.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), grad_v, q.new_empty((B, H), dtype=accumulation_dtype(q.dtype))


def _no_gradient_reached_intermediates(grads) -> bool:
    return all(g is None for g in grads[1:])


def _derivatives(backward_op) -> Derivatives:
    def backward(inputs, outputs, grads):
        q, k, v, key_padding_mask, alpha, scale = inputs
        _, factor, weights = outputs
        grad_q, grad_k, grad_v, grad_alpha = backward_op(grads[0], q, k, v, key_padding_mask, factor, weights, scale)
        return grad_q, grad_k, None if v is None else grad_v, None, grad_alpha.to(alpha.dtype), None

    return Derivatives(backward, composite.intention, differentiable_inputs=(0, 1, 2, 4),
                       differentiable_outputs=(0, 1, 2), exact_first_order=_no_gradient_reached_intermediates)


register_op_pair("attn_ext::intention_fwd_triton", "attn_ext::intention_bwd_triton", _fake_forward, _fake_backward,
                 _derivatives, "attn_ext.intention")
if extension_error() is None:
    register_op_pair("attn_ext::intention_fwd", "attn_ext::intention_bwd", _fake_forward, _fake_backward,
                     _derivatives, "attn_ext.intention")


# σIntention's fused CPU forward (csrc/cpu/sigma_intention.cpp) returns what intention_fwd(v=None) and
# cross_attention_fwd(q_tilde, k, v, scale=1) would: its backward is theirs, composed (no op of its own).
def _fake_sigma_forward(q, k, v, key_padding_mask, alpha, scale, chunk_size):
    B, H, M, D = q.shape
    acc = accumulation_dtype(q.dtype)
    return (q.new_empty((B, H, M, v.shape[-1])), q.new_empty((B, H, M), dtype=acc), q.new_empty((B, H, M, D)),
            q.new_empty((B, H, D, D), dtype=acc), q.new_empty((B, H, D, D), dtype=acc))


def _sigma_backward(inputs, outputs, grads):
    q, k, v, key_padding_mask, alpha, scale, chunk_size = inputs
    out, lse, q_tilde, factor, weights = outputs
    grad_out, grad_lse, grad_q_tilde = grads[:3]
    grad_qt, grad_k, grad_v = torch.ops.attn_ext.cross_attention_bwd(grad_out, grad_lse, q_tilde, k, v, key_padding_mask,
                                                                      out, lse, 1.0, chunk_size)
    grad_qt = grad_qt + grad_q_tilde  # q_tilde is an intermediate the public function never returns, but exact
    grad_q, grad_k_gram, _, grad_alpha = torch.ops.attn_ext.intention_bwd(grad_qt, q, k, None, key_padding_mask, factor,
                                                                         weights, scale)
    return grad_q, grad_k + grad_k_gram, grad_v, None, grad_alpha.to(alpha.dtype), None, None


def _sigma_exact(grads) -> bool:
    return grads[3] is None and grads[4] is None


if extension_error() is None:
    torch.library.register_fake("attn_ext::sigma_intention_fwd")(_fake_sigma_forward)
    register_derivatives("attn_ext::sigma_intention_fwd",
                         Derivatives(_sigma_backward, composite.sigma_intention, differentiable_inputs=(0, 1, 2, 4),
                                     differentiable_outputs=(0, 1, 2, 3, 4), exact_first_order=_sigma_exact),
                         "attn_ext.sigma_intention")


# Batched Cholesky (docs/spec.md §4): fakes, and an autograd formula for the factor and the solve that raises
# (without any formula torch would only warn and let gradients silently stop at these ops).

def _fake_cholesky(A: Tensor) -> Tuple[Tensor, Tensor]:
    _check_square("batched_cholesky", "A", A)
    return A.new_empty(A.shape), A.new_empty(A.shape[:-2], dtype=torch.int32)


def _fake_cholesky_solve(L: Tensor, B: Tensor) -> Tensor:
    _check_matrix_and_rhs("batched_cholesky_solve", "L", L, B)
    return B.new_empty(B.shape)


if extension_error() is None:
    torch.library.register_fake("attn_ext::batched_cholesky")(_fake_cholesky)
    torch.library.register_fake("attn_ext::batched_cholesky_solve")(_fake_cholesky_solve)
    for _op in ("batched_cholesky", "batched_cholesky_solve"):
        register_not_differentiable(
            f"attn_ext::{_op}", "by design (the Intention op's backward reuses the factor by hand); use "
            "torch.linalg.cholesky / torch.cholesky_solve where gradients are needed, or attn_ext.batched_spd_solve")


def _fake_spd_solve(A: Tensor, B: Tensor) -> Tuple[Tensor, Tensor]:
    _check_matrix_and_rhs("batched_spd_solve", "A", A, B)
    return B.new_empty(B.shape), A.new_empty(A.shape[:-2], dtype=torch.int32)


def _spd_solve_backward(inputs, outputs, grads):
    A, _ = inputs
    X, _ = outputs
    grad_b = torch.ops.attn_ext.batched_spd_solve(A, grads[0].contiguous())[0]
    g = -(grad_b @ X.mT)
    grad_a = (g + g.mT).tril() - torch.diag_embed(g.diagonal(dim1=-2, dim2=-1))
    return grad_a, grad_b


def _cuda_composition(A: Tensor, B: Tensor) -> Tuple[Tensor, Tensor]:
    """CUDA: the batched Cholesky then solve kernels (no fused CUDA kernel yet), NaN where A is not SPD."""
    L, info = torch.ops.attn_ext.batched_cholesky(A)
    X = torch.ops.attn_ext.batched_cholesky_solve(L, B)
    return X.masked_fill((info != 0)[..., None, None], float("nan")), info


if extension_error() is None:
    if torch._C._dispatch_has_kernel_for_dispatch_key("attn_ext::batched_cholesky", "CUDA"):
        torch.library.impl("attn_ext::batched_spd_solve", "CUDA")(_cuda_composition)
    torch.library.register_fake("attn_ext::batched_spd_solve")(_fake_spd_solve)
    register_derivatives("attn_ext::batched_spd_solve",
                         Derivatives(_spd_solve_backward, composite.spd_solve, differentiable_inputs=(0, 1),
                                     differentiable_outputs=(0,)), "attn_ext.batched_spd_solve")


def _within_triton_tiles(q, context):
    from attn_ext.ops.intention.triton_ridge import MAX_HEAD_DIM, MAX_VALUE_DIM

    if q.shape[-1] > MAX_HEAD_DIM or context.get("value_dim", 0) > MAX_VALUE_DIM:
        return (f"the Triton kernels hold the [D, D] factor in registers: D <= {MAX_HEAD_DIM} and "
                f"Dv <= {MAX_VALUE_DIM}, got D = {q.shape[-1]}, Dv = {context.get('value_dim')}")
    return None


# The dual form (N < D) is PyTorch code whatever the backend (see ``form`` of attn_ext.intention).
declare("intention", cpp=Implementation("intention_fwd"), cuda=Implementation("intention_fwd"),
        triton=Implementation("intention_fwd_triton", (_within_triton_tiles,)), reference=Implementation())
# σIntention: fused on the CPU; CUDA and Triton make Q̃ with the Intention kernel without values (C = I) or
# the reference, then run their cross attention.
declare("sigma_intention", cpp=Implementation("sigma_intention_fwd"), cuda=Implementation("intention_fwd"),
        triton=Implementation("cross_attention_fwd_triton"), reference=Implementation())
for _op in ("batched_cholesky", "batched_cholesky_solve", "batched_spd_solve"):
    declare(_op, cpp=Implementation(_op), cuda=Implementation(_op))
