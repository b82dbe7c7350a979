"""Custom ops of the chunked cross-attention family: schemas of the Python backends, fake kernels,
autograd, and the backends each public op has (the dispatch table of :mod:`attn_ext.ops.utils.dispatch`).

Every backend of ``cross_attention`` exposes a forward op ``(q, k, v, key_padding_mask, scale,
chunk_size) -> (out, lse)`` and a backward op with the gradients of ``out`` and ``lse`` prepended and
``out, lse`` appended; ``merge_states`` likewise ``(out_a, lse_a, out_b, lse_b) -> (out, lse)``:

* ``attn_ext::cross_attention_fwd`` / ``_bwd``, ``merge_states_fwd`` / ``_bwd``: the compiled kernels
  (C++ for CPU tensors, CUDA for CUDA tensors; schemas and kernels registered in C++);
* ``..._fwd_reference`` / ``..._bwd_reference``: :mod:`attn_ext.ops.cross_attention.naive`;
* ``..._fwd_triton`` / ``..._bwd_triton``: the Triton kernels of this folder.

All forward ops of an op share one autograd formula (docs/spec.md §1): the backward op of the same backend
is called with the saved inputs and the final ``(out, lse)``, so no [M, N] matrix is kept between
the passes. Higher derivatives, forward mode and ``torch.func`` differentiate :mod:`.composite` instead
(:mod:`attn_ext.ops.utils.autograd`).
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

from torch import Tensor

from attn_ext.ops.cross_attention import composite
from attn_ext.ops.cross_attention import naive as reference
from attn_ext.ops.utils.autograd import Derivatives
from attn_ext.ops.utils.cuda_capability import bf16_tensor_core_reason
from attn_ext.ops.utils.dispatch import Implementation, declare
from attn_ext.ops.utils.dtypes import accumulation_dtype
from attn_ext.ops.utils.extension import extension_error
from attn_ext.ops.utils.registration import define_op, register_op_pair
from attn_ext.ops.utils.score_range import check_scores_in_range
from attn_ext.ops.utils.validation import check_cross_attention_args

_FwdResult = Tuple[Tensor, Tensor]
_BwdResult = Tuple[Tensor, Tensor, Tensor]


@define_op("attn_ext::cross_attention_fwd_reference")
def _cross_attention_fwd_reference(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], scale: float, chunk_size: int
) -> _FwdResult:
    # Direct torch.ops calls bypass the public API: check here too, as the C++ ops do.
    check_cross_attention_args(q, k, v, key_padding_mask, scale, chunk_size, op="cross_attention")
    out, lse = reference.cross_attention_forward(q, k, v, key_padding_mask, scale, chunk_size)
    check_scores_in_range("cross_attention", q, k, v, out, lse, scale, key_padding_mask=key_padding_mask)
    return out, lse


@define_op("attn_ext::cross_attention_bwd_reference")
def _cross_attention_bwd_reference(
    grad_out: Tensor, grad_lse: Tensor, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor],
    out: Tensor, lse: Tensor, scale: float, chunk_size: int,
) -> _BwdResult:
    check_cross_attention_args(q, k, v, key_padding_mask, scale, chunk_size, op="cross_attention")
    return reference.cross_attention_backward(grad_out, grad_lse, q, k, v, key_padding_mask, out, lse, scale, chunk_size)


@define_op("attn_ext::cross_attention_fwd_triton")
def _cross_attention_fwd_triton(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], scale: float, chunk_size: int
) -> _FwdResult:
    from attn_ext.ops.cross_attention.triton_fwd import cross_attention_forward

    return cross_attention_forward(q, k, v, key_padding_mask, scale, chunk_size)


@define_op("attn_ext::cross_attention_bwd_triton")
def _cross_attention_bwd_triton(
    grad_out: Tensor, grad_lse: Tensor, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor],
    out: Tensor, lse: Tensor, scale: float, chunk_size: int,
) -> _BwdResult:
    from attn_ext.ops.cross_attention.triton_bwd import cross_attention_backward

    return cross_attention_backward(grad_out, grad_lse, q, k, v, key_padding_mask, out, lse, scale, chunk_size)


def _fake_forward(q, k, v, key_padding_mask, scale, chunk_size):
    B, H, M, _ = q.shape
    out = q.new_empty((B, H, M, v.shape[-1]))
    lse = q.new_empty((B, H, M), dtype=accumulation_dtype(q.dtype))
    return out, lse


def _fake_backward(grad_out, grad_lse, q, k, v, key_padding_mask, out, lse, scale, chunk_size):
    # Every backend returns contiguous gradients whatever the inputs' strides (empty_like would copy them).
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _derivatives(backward_op: Callable[..., _BwdResult]) -> Derivatives:
    def backward(inputs, outputs, grads):
        q, k, v, key_padding_mask, scale, chunk_size = inputs
        out, lse = outputs
        grad_q, grad_k, grad_v = backward_op(grads[0], grads[1], q, k, v, key_padding_mask, out, lse, scale,
                                             chunk_size)
        return grad_q, grad_k, grad_v, None, None, None

    return Derivatives(backward, composite.cross_attention, differentiable_inputs=(0, 1, 2),
                       differentiable_outputs=(0, 1))


def _register(forward_name: str, backward_name: str) -> None:
    register_op_pair(forward_name, backward_name, _fake_forward, _fake_backward, _derivatives,
                     "attn_ext.cross_attention", backward_layout="g0 g1 i0 i1 i2 i3 o0 o1 i4 i5")


_register("attn_ext::cross_attention_fwd_reference", "attn_ext::cross_attention_bwd_reference")
_register("attn_ext::cross_attention_fwd_triton", "attn_ext::cross_attention_bwd_triton")
if extension_error() is None:
    _register("attn_ext::cross_attention_fwd", "attn_ext::cross_attention_bwd")


# Merge of two attention states (docs/spec.md §1 merge): (out_a, lse_a, out_b, lse_b) -> (out, lse)
_MergeBwdResult = Tuple[Tensor, Tensor, Tensor, Tensor]


@define_op("attn_ext::merge_states_fwd_reference")
def _merge_states_fwd_reference(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> _FwdResult:
    return reference.merge_states_forward(out_a, lse_a, out_b, lse_b)


@define_op("attn_ext::merge_states_bwd_reference")
def _merge_states_bwd_reference(
    grad_out: Tensor, grad_lse: Tensor, out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, out: Tensor,
    lse: Tensor,
) -> _MergeBwdResult:
    return reference.merge_states_backward(grad_out, grad_lse, out_a, lse_a, out_b, lse_b, out, lse)


@define_op("attn_ext::merge_states_fwd_triton")
def _merge_states_fwd_triton(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> _FwdResult:
    from attn_ext.ops.cross_attention.triton_merge import merge_states_forward

    return merge_states_forward(out_a, lse_a, out_b, lse_b)


@define_op("attn_ext::merge_states_bwd_triton")
def _merge_states_bwd_triton(
    grad_out: Tensor, grad_lse: Tensor, out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, out: Tensor,
    lse: Tensor,
) -> _MergeBwdResult:
    from attn_ext.ops.cross_attention.triton_merge import merge_states_backward

    return merge_states_backward(grad_out, grad_lse, out_a, lse_a, out_b, lse_b, out, lse)


def _fake_merge(out_a, lse_a, out_b, lse_b):
    return out_a.new_empty(out_a.shape), lse_a.new_empty(lse_a.shape)


def _fake_merge_backward(grad_out, grad_lse, out_a, lse_a, out_b, lse_b, out, lse):
    return (out_a.new_empty(out_a.shape), lse_a.new_empty(lse_a.shape), out_b.new_empty(out_b.shape),
            lse_b.new_empty(lse_b.shape))


def _merge_derivatives(backward_op: Callable[..., _MergeBwdResult]) -> Derivatives:
    def backward(inputs, outputs, grads):
        return backward_op(grads[0], grads[1], *inputs, *outputs)

    return Derivatives(backward, composite.merge_states, differentiable_inputs=(0, 1, 2, 3),
                       differentiable_outputs=(0, 1))


def _register_merge(forward_name: str, backward_name: str) -> None:
    register_op_pair(forward_name, backward_name, _fake_merge, _fake_merge_backward, _merge_derivatives,
                     "attn_ext.merge_states", backward_layout="g0 g1 i0 i1 i2 i3 o0 o1")


_register_merge("attn_ext::merge_states_fwd_reference", "attn_ext::merge_states_bwd_reference")
_register_merge("attn_ext::merge_states_fwd_triton", "attn_ext::merge_states_bwd_triton")
if extension_error() is None:
    _register_merge("attn_ext::merge_states_fwd", "attn_ext::merge_states_bwd")

declare("cross_attention", cpp=Implementation("cross_attention_fwd"),
        cuda=Implementation("cross_attention_fwd", (bf16_tensor_core_reason,)),
        triton=Implementation("cross_attention_fwd_triton"), reference=Implementation("cross_attention_fwd_reference"))
declare("merge_states", cpp=Implementation("merge_states_fwd"), cuda=Implementation("merge_states_fwd"),
        triton=Implementation("merge_states_fwd_triton"), reference=Implementation("merge_states_fwd_reference"))
