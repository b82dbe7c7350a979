"""Custom ops of the Intention family: the Python backends' schemas, fake kernels, autograd, and the
backends each public op has (the dispatch table of :mod:`attn_ext.ops.utils.dispatch`).

**Intention** (docs/spec.md §0, §4).

``attn_ext::intention_fwd`` (C++, csrc/cpu/intention.cpp; schema in csrc/schemas.cpp) returns
``(out, factor, weights)``: the output, the Cholesky factor ``L`` of ``KᵀK + αI`` and
``W = (KᵀK + αI)⁻¹KᵀV``, both kept for ``attn_ext::intention_bwd``, which needs one more solve with
``L`` and no inverse. ``factor`` and ``weights`` are intermediates: gradients reaching them are
ignored (the public functions never return them). ``..._fwd_triton`` / ``..._bwd_triton`` are the
same contract on the Triton kernels (:mod:`.triton_ridge`, :mod:`.triton_solve`), defined here.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from attn_ext.ops.intention.cholesky import _check_matrix_and_rhs, _check_square
from attn_ext.ops.utils.dispatch import Implementation, declare
from attn_ext.ops.utils.dtypes import accumulation_dtype
from attn_ext.ops.utils.extension import extension_error
from attn_ext.ops.utils.registration import register_op_pair


@torch.library.custom_op("attn_ext::intention_fwd_triton", mutates_args=())
def _intention_fwd_triton(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], alpha: Tensor,
                          scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    from attn_ext.ops.intention.triton_ridge import intention_fwd_triton

    return intention_fwd_triton(q, k, v, key_padding_mask, alpha, scale)


@torch.library.custom_op("attn_ext::intention_bwd_triton", mutates_args=())
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


def _setup_context(ctx, inputs, output):
    q, k, v, key_padding_mask, alpha, scale = inputs
    out, factor, weights = output
    ctx.save_for_backward(q, k, v, key_padding_mask, factor, weights)
    ctx.scale, ctx.alpha_dtype = scale, alpha.dtype


def _autograd_backward(backward_op):
    def backward(ctx, grad_out: Optional[Tensor], grad_factor, grad_weights):
        q, k, v, key_padding_mask, factor, weights = ctx.saved_tensors
        if grad_out is None:
            grad_out = q.new_zeros((*q.shape[:3], weights.shape[-1]))
        grad_q, grad_k, grad_v, grad_alpha = backward_op(grad_out, q, k, v, key_padding_mask, factor, weights,
                                                         ctx.scale)
        return grad_q, grad_k, None if v is None else grad_v, None, grad_alpha.to(ctx.alpha_dtype), None

    return backward


register_op_pair("attn_ext::intention_fwd_triton", "attn_ext::intention_bwd_triton", _fake_forward, _fake_backward,
                 _autograd_backward, _setup_context)
if extension_error() is None:
    register_op_pair("attn_ext::intention_fwd", "attn_ext::intention_bwd", _fake_forward, _fake_backward,
                     _autograd_backward, _setup_context)


# σIntention's fused CPU forward (csrc/cpu/sigma_intention.cpp) returns what intention_fwd(v=None) and
# cross_attention_fwd(q_tilde, k, v, scale=1) would: its backward is theirs, composed (no op of its own).
def _fake_sigma_forward(q, k, v, key_padding_mask, alpha, scale, chunk_size):
    B, H, M, D = q.shape
    acc = accumulation_dtype(q.dtype)
    return (q.new_empty((B, H, M, v.shape[-1])), q.new_empty((B, H, M), dtype=acc), q.new_empty((B, H, M, D)),
            q.new_empty((B, H, D, D), dtype=acc), q.new_empty((B, H, D, D), dtype=acc))


def _setup_sigma_context(ctx, inputs, output):
    q, k, v, key_padding_mask, alpha, scale, chunk_size = inputs
    out, lse, q_tilde, factor, weights = output
    ctx.save_for_backward(q, k, v, key_padding_mask, out, lse, q_tilde, factor, weights)
    ctx.scale, ctx.chunk_size, ctx.alpha_dtype = scale, chunk_size, alpha.dtype


def _sigma_backward(ctx, grad_out, grad_lse, grad_q_tilde, grad_factor, grad_weights):
    q, k, v, key_padding_mask, out, lse, q_tilde, factor, weights = ctx.saved_tensors
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
    grad_qt, grad_k, grad_v = torch.ops.attn_ext.cross_attention_bwd(grad_out, grad_lse, q_tilde, k, v, key_padding_mask,
                                                                      out, lse, 1.0, ctx.chunk_size)
    if grad_q_tilde is not None:  # q_tilde is an intermediate the public function never returns, but exact anyway
        grad_qt = grad_qt + grad_q_tilde
    grad_q, grad_k_gram, _, grad_alpha = torch.ops.attn_ext.intention_bwd(grad_qt, q, k, None, key_padding_mask, factor,
                                                                         weights, ctx.scale)
    return grad_q, grad_k + grad_k_gram, grad_v, None, grad_alpha.to(ctx.alpha_dtype), None, None


if extension_error() is None:
    torch.library.register_fake("attn_ext::sigma_intention_fwd")(_fake_sigma_forward)
    torch.library.register_autograd("attn_ext::sigma_intention_fwd", _sigma_backward,
                                    setup_context=_setup_sigma_context)


# Batched Cholesky (docs/spec.md §4): fakes, and an autograd formula for the factor and the solve that raises
# (without any formula torch would only warn and let gradients silently stop at these ops).

def _fake_cholesky(A: Tensor) -> Tuple[Tensor, Tensor]:
    _check_square("batched_cholesky", "A", A)
    return A.new_empty(A.shape), A.new_empty(A.shape[:-2], dtype=torch.int32)


def _fake_cholesky_solve(L: Tensor, B: Tensor) -> Tensor:
    _check_matrix_and_rhs("batched_cholesky_solve", "L", L, B)
    return B.new_empty(B.shape)


def _not_differentiable(op: str):
    def backward(ctx, *grads):
        raise RuntimeError(f"attn_ext.{op} is not differentiable (by design: the Intention op's backward will "
                           "reuse the factor by hand); use torch.linalg.cholesky / torch.cholesky_solve where "
                           "gradients are needed")

    return backward


if extension_error() is None:
    torch.library.register_fake("attn_ext::batched_cholesky")(_fake_cholesky)
    torch.library.register_fake("attn_ext::batched_cholesky_solve")(_fake_cholesky_solve)
    for _op in ("batched_cholesky", "batched_cholesky_solve"):
        torch.library.register_autograd(f"attn_ext::{_op}", _not_differentiable(_op))


def _fake_spd_solve(A: Tensor, B: Tensor) -> Tuple[Tensor, Tensor]:
    _check_matrix_and_rhs("batched_spd_solve", "A", A, B)
    return B.new_empty(B.shape), A.new_empty(A.shape[:-2], dtype=torch.int32)


def _setup_spd_solve_context(ctx, inputs, output) -> None:
    A, _ = inputs
    X, info = output
    ctx.mark_non_differentiable(info)
    ctx.save_for_backward(A, X)


def _spd_solve_backward(ctx, grad_x: Tensor, _grad_info) -> Tuple[Tensor, Tensor]:
    A, X = ctx.saved_tensors
    if grad_x is None:
        return None, None
    grad_b = torch.ops.attn_ext.batched_spd_solve(A, grad_x.contiguous())[0]
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
    torch.library.register_autograd("attn_ext::batched_spd_solve", _spd_solve_backward, setup_context=_setup_spd_solve_context)


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
