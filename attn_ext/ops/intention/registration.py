"""torch.library registrations of the Intention ops (SPEC §0, §4).

``attn_ext::intention_fwd`` (C++, csrc/cpu/intention.cpp; schema in csrc/ops.cpp) returns
``(out, factor, weights)``: the output, the Cholesky factor ``L`` of ``KᵀK + αI`` and
``W = (KᵀK + αI)⁻¹KᵀV``, both kept for ``attn_ext::intention_bwd``, which needs one more solve with
``L`` and no inverse. ``factor`` and ``weights`` are intermediates: gradients reaching them are
ignored (the public functions never return them). ``..._fwd_triton`` / ``..._bwd_triton`` are the
same contract on the Triton kernels (attn_ext/triton/intention*.py), defined here.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from attn_ext._extension import extension_error
from attn_ext._registration import register_op_pair


@torch.library.custom_op("attn_ext::intention_fwd_triton", mutates_args=())
def _intention_fwd_triton(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], alpha: Tensor,
                          scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    from attn_ext.triton.intention import intention_fwd_triton

    return intention_fwd_triton(q, k, v, key_padding_mask, alpha, scale)


@torch.library.custom_op("attn_ext::intention_bwd_triton", mutates_args=())
def _intention_bwd_triton(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor],
                          factor: Tensor, weights: Tensor, scale: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    from attn_ext.triton.intention import intention_bwd_triton

    return intention_bwd_triton(grad_out, q, k, v, key_padding_mask, factor, weights, scale)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fake_forward(q, k, v, key_padding_mask, alpha, scale):
    B, H, M, D = q.shape
    Dv = D if v is None else v.shape[-1]  # no values: C = I, the transformed queries
    acc = _accumulation_dtype(q.dtype)
    return q.new_empty((B, H, M, Dv)), q.new_empty((B, H, D, D), dtype=acc), q.new_empty((B, H, D, Dv), dtype=acc)


def _fake_backward(grad_out, q, k, v, key_padding_mask, factor, weights, scale):
    B, H = q.shape[:2]
    grad_v = q.new_empty((0,)) if v is None else v.new_empty(v.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), grad_v, q.new_empty((B, H), dtype=_accumulation_dtype(q.dtype))


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
    acc = _accumulation_dtype(q.dtype)
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
