"""torch.library registrations: the Python-implemented ops, fake kernels and autograd formulas.

Every backend exposes a forward op ``(q, k, v, key_padding_mask, scale, chunk_size) -> (out, lse)``
and a backward op with the gradients of ``out`` and ``lse`` prepended and ``out, lse`` appended:

* ``attn_ext::cross_attention_fwd`` / ``_bwd``: compiled kernels (csrc/, registered in C++);
* ``attn_ext::cross_attention_fwd_reference`` / ``_bwd_reference``: attn_ext/reference.py;
* ``attn_ext::cross_attention_fwd_triton`` / ``_bwd_triton``: attn_ext/triton/.

All forward ops share one autograd formula (SPEC §1): the backward op of the same backend is called
with the saved inputs and the final ``(out, lse)``, so no [M, N] matrix is kept between the passes.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from attn_ext import reference
from attn_ext._extension import extension_error
from attn_ext._registration import register_op_pair
from attn_ext._validation import check_cross_attention_args

_FwdResult = Tuple[Tensor, Tensor]
_BwdResult = Tuple[Tensor, Tensor, Tensor]


@torch.library.custom_op("attn_ext::cross_attention_fwd_reference", mutates_args=())
def _cross_attention_fwd_reference(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], scale: float, chunk_size: int
) -> _FwdResult:
    # Direct torch.ops calls bypass the public API: check here too, as the C++ ops do.
    check_cross_attention_args(q, k, v, key_padding_mask, scale, chunk_size)
    return reference.cross_attention_forward(q, k, v, key_padding_mask, scale, chunk_size)


@torch.library.custom_op("attn_ext::cross_attention_bwd_reference", mutates_args=())
def _cross_attention_bwd_reference(
    grad_out: Tensor, grad_lse: Tensor, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor],
    out: Tensor, lse: Tensor, scale: float, chunk_size: int,
) -> _BwdResult:
    check_cross_attention_args(q, k, v, key_padding_mask, scale, chunk_size)
    return reference.cross_attention_backward(grad_out, grad_lse, q, k, v, key_padding_mask, out, lse, scale, chunk_size)


@torch.library.custom_op("attn_ext::cross_attention_fwd_triton", mutates_args=())
def _cross_attention_fwd_triton(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], scale: float, chunk_size: int
) -> _FwdResult:
    from attn_ext.triton.cross_attention_fwd import cross_attention_forward

    return cross_attention_forward(q, k, v, key_padding_mask, scale, chunk_size)


@torch.library.custom_op("attn_ext::cross_attention_bwd_triton", mutates_args=())
def _cross_attention_bwd_triton(
    grad_out: Tensor, grad_lse: Tensor, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor],
    out: Tensor, lse: Tensor, scale: float, chunk_size: int,
) -> _BwdResult:
    from attn_ext.triton.cross_attention_bwd import cross_attention_backward

    return cross_attention_backward(grad_out, grad_lse, q, k, v, key_padding_mask, out, lse, scale, chunk_size)


def _fake_forward(q, k, v, key_padding_mask, scale, chunk_size):
    B, H, M, _ = q.shape
    out = q.new_empty((B, H, M, v.shape[-1]))
    lse = q.new_empty((B, H, M), dtype=reference.accumulation_dtype(q.dtype))
    return out, lse


def _fake_backward(grad_out, grad_lse, q, k, v, key_padding_mask, out, lse, scale, chunk_size):
    # Every backend returns contiguous gradients whatever the inputs' strides (empty_like would copy them).
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, key_padding_mask, scale, chunk_size = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, key_padding_mask, out, lse)
    ctx.scale, ctx.chunk_size = scale, chunk_size


def _autograd_backward(backward_op: Callable[..., _BwdResult]):
    def backward(ctx, grad_out: Optional[Tensor], grad_lse: Optional[Tensor]):
        q, k, v, key_padding_mask, out, lse = ctx.saved_tensors
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out
        grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
        grad_q, grad_k, grad_v = backward_op(
            grad_out, grad_lse, q, k, v, key_padding_mask, out, lse, ctx.scale, ctx.chunk_size
        )
        return grad_q, grad_k, grad_v, None, None, None

    return backward


def _register(forward_name: str, backward_name: str) -> None:
    register_op_pair(forward_name, backward_name, _fake_forward, _fake_backward, _autograd_backward, _setup_context)


_register("attn_ext::cross_attention_fwd_reference", "attn_ext::cross_attention_bwd_reference")
_register("attn_ext::cross_attention_fwd_triton", "attn_ext::cross_attention_bwd_triton")
if extension_error() is None:
    _register("attn_ext::cross_attention_fwd", "attn_ext::cross_attention_bwd")


# ----------------------------------------------------------------------------------------------
# Merge of two attention states (SPEC §1 merge): (out_a, lse_a, out_b, lse_b) -> (out, lse)
# ----------------------------------------------------------------------------------------------
_MergeBwdResult = Tuple[Tensor, Tensor, Tensor, Tensor]


@torch.library.custom_op("attn_ext::merge_states_fwd_reference", mutates_args=())
def _merge_reference(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> _FwdResult:
    return reference.merge_attention_states(out_a, lse_a, out_b, lse_b)


@torch.library.custom_op("attn_ext::merge_states_bwd_reference", mutates_args=())
def _merge_bwd_reference(
    grad_out: Tensor, grad_lse: Tensor, out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, out: Tensor,
    lse: Tensor,
) -> _MergeBwdResult:
    return reference.merge_attention_states_backward(grad_out, grad_lse, out_a, lse_a, out_b, lse_b, out, lse)


@torch.library.custom_op("attn_ext::merge_states_fwd_triton", mutates_args=())
def _merge_triton(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> _FwdResult:
    from attn_ext.triton.merge_states import merge_attention_states

    return merge_attention_states(out_a, lse_a, out_b, lse_b)


@torch.library.custom_op("attn_ext::merge_states_bwd_triton", mutates_args=())
def _merge_bwd_triton(
    grad_out: Tensor, grad_lse: Tensor, out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, out: Tensor,
    lse: Tensor,
) -> _MergeBwdResult:
    from attn_ext.triton.merge_states import merge_attention_states_backward

    return merge_attention_states_backward(grad_out, grad_lse, out_a, lse_a, out_b, lse_b, out, lse)


def _fake_merge(out_a, lse_a, out_b, lse_b):
    return out_a.new_empty(out_a.shape), lse_a.new_empty(lse_a.shape)


def _fake_merge_backward(grad_out, grad_lse, out_a, lse_a, out_b, lse_b, out, lse):
    return (out_a.new_empty(out_a.shape), lse_a.new_empty(lse_a.shape), out_b.new_empty(out_b.shape),
            lse_b.new_empty(lse_b.shape))


def _setup_merge_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)


def _merge_autograd_backward(backward_op: Callable[..., _MergeBwdResult]):
    def backward(ctx, grad_out: Optional[Tensor], grad_lse: Optional[Tensor]):
        out_a, lse_a, out_b, lse_b, out, lse = ctx.saved_tensors
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out
        grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
        return backward_op(grad_out, grad_lse, out_a, lse_a, out_b, lse_b, out, lse)

    return backward


def _register_merge(forward_name: str, backward_name: str) -> None:
    register_op_pair(forward_name, backward_name, _fake_merge, _fake_merge_backward, _merge_autograd_backward,
                     _setup_merge_context)


_register_merge("attn_ext::merge_states_fwd_reference", "attn_ext::merge_states_bwd_reference")
_register_merge("attn_ext::merge_states_fwd_triton", "attn_ext::merge_states_bwd_triton")
if extension_error() is None:
    _register_merge("attn_ext::merge_states_fwd", "attn_ext::merge_states_bwd")

#: backend name -> (forward op, backward op)
CROSS_ATTENTION_OPS: Dict[str, Tuple[str, str]] = {
    "cpp": ("cross_attention_fwd", "cross_attention_bwd"),
    "cuda": ("cross_attention_fwd", "cross_attention_bwd"),  # the same ops: they dispatch on the device
    "reference": ("cross_attention_fwd_reference", "cross_attention_bwd_reference"),
    "triton": ("cross_attention_fwd_triton", "cross_attention_bwd_triton"),
}


#: backend name -> (merge op, merge backward op)
MERGE_OPS: Dict[str, Tuple[str, str]] = {
    "cpp": ("merge_states_fwd", "merge_states_bwd"),
    "cuda": ("merge_states_fwd", "merge_states_bwd"),
    "reference": ("merge_states_fwd_reference", "merge_states_bwd_reference"),
    "triton": ("merge_states_fwd_triton", "merge_states_bwd_triton"),
}


def merge_op(backend: str):
    """The ``torch.ops.attn_ext`` state-merge op of a backend."""
    return getattr(torch.ops.attn_ext, MERGE_OPS[backend][0])


def forward_op(backend: str):
    """The ``torch.ops.attn_ext`` forward op of a backend."""
    return getattr(torch.ops.attn_ext, CROSS_ATTENTION_OPS[backend][0])


def backward_op(backend: str):
    """The ``torch.ops.attn_ext`` backward op of a backend."""
    return getattr(torch.ops.attn_ext, CROSS_ATTENTION_OPS[backend][1])
