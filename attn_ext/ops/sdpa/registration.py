"""Custom ops of masked attention (``scaled_dot_product_attention``): schemas of the Python backends,
fake kernels, autograd, and the backends the op declares.

Every backend exposes the forward ``(q, k, v, attn_mask, key_padding_mask, scale, is_causal, dropout_p,
dropout_seed, chunk_size) -> (out, lse)`` and the backward with the gradients of ``out`` and ``lse``
prepended and ``out, lse`` inserted after the masks:

* ``attn_ext::attention_fwd`` / ``_bwd``: the compiled kernels (C++ for CPU tensors, CUDA for CUDA
  tensors; schemas and kernels registered in C++);
* ``..._reference``: :mod:`attn_ext.ops.sdpa.naive`;
* ``..._triton``: the Triton kernels of this folder.

All share one autograd formula; higher derivatives differentiate :mod:`.composite`.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Tuple

import torch
from torch import Tensor

from attn_ext.ops.sdpa import composite
from attn_ext.ops.sdpa import naive as reference
from attn_ext.ops.utils.autograd import Derivatives
from attn_ext.ops.utils.cuda_capability import bf16_tensor_core_reason
from attn_ext.ops.utils.dispatch import Implementation, declare
from attn_ext.ops.utils.dtypes import accumulation_dtype
from attn_ext.ops.utils.extension import extension_error
from attn_ext.ops.utils.registration import define_op, register_op_pair
from attn_ext.ops.utils.score_range import check_scores_in_range

_FwdResult = Tuple[Tensor, Tensor]
_BwdResult = Tuple[Tensor, Tensor, Tensor]


@define_op("attn_ext::attention_fwd_reference")
def _attention_fwd_reference(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], scale: float,
    is_causal: bool, dropout_p: float, dropout_seed: Optional[Tensor], chunk_size: int,
) -> _FwdResult:
    out, lse = reference.attention_forward(q, k, v, attn_mask, key_padding_mask, scale, is_causal, dropout_p,
                                           dropout_seed, chunk_size)
    check_scores_in_range("scaled_dot_product_attention", q, k, v, out, lse, scale, attn_mask, key_padding_mask,
                          is_causal)
    return out, lse


@define_op("attn_ext::attention_bwd_reference")
def _attention_bwd_reference(
    grad_out: Tensor, grad_lse: Tensor, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
    key_padding_mask: Optional[Tensor], out: Tensor, lse: Tensor, scale: float, is_causal: bool, dropout_p: float,
    dropout_seed: Optional[Tensor], chunk_size: int,
) -> _BwdResult:
    return reference.attention_backward(grad_out, grad_lse, q, k, v, attn_mask, key_padding_mask, out, lse, scale,
                                        is_causal, dropout_p, dropout_seed, chunk_size)


@define_op("attn_ext::attention_fwd_triton")
def _attention_fwd_triton(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], scale: float,
    is_causal: bool, dropout_p: float, dropout_seed: Optional[Tensor], chunk_size: int,
) -> _FwdResult:
    from attn_ext.ops.sdpa.triton_fwd import attention_forward

    return attention_forward(q, k, v, attn_mask, key_padding_mask, scale, is_causal, dropout_p, dropout_seed,
                             chunk_size)


@define_op("attn_ext::attention_bwd_triton")
def _attention_bwd_triton(
    grad_out: Tensor, grad_lse: Tensor, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
    key_padding_mask: Optional[Tensor], out: Tensor, lse: Tensor, scale: float, is_causal: bool, dropout_p: float,
    dropout_seed: Optional[Tensor], chunk_size: int,
) -> _BwdResult:
    from attn_ext.ops.sdpa.triton_bwd import attention_backward

    return attention_backward(grad_out, grad_lse, q, k, v, attn_mask, key_padding_mask, out, lse, scale, is_causal,
                              dropout_p, dropout_seed, chunk_size)


def _fake_forward(q, k, v, attn_mask, key_padding_mask, scale, is_causal, dropout_p, dropout_seed, chunk_size):
    B, H, L, _ = q.shape
    return q.new_empty((B, H, L, v.shape[-1])), q.new_empty((B, H, L), dtype=accumulation_dtype(q.dtype))


def _fake_backward(grad_out, grad_lse, q, k, v, attn_mask, key_padding_mask, out, lse, scale, is_causal, dropout_p,
                   dropout_seed, chunk_size):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _derivatives(backward_op: Callable[..., _BwdResult]) -> Derivatives:
    def backward(inputs, outputs, grads):
        q, k, v, attn_mask, key_padding_mask, scale, is_causal, dropout_p, dropout_seed, chunk_size = inputs
        out, lse = outputs
        grad_q, grad_k, grad_v = backward_op(grads[0], grads[1], q, k, v, attn_mask, key_padding_mask, out, lse,
                                             scale, is_causal, dropout_p, dropout_seed, chunk_size)
        return grad_q, grad_k, grad_v, None, None, None, None, None, None, None

    # A float attn_mask is differentiable too, in both modes: its gradient is the [L, S] score gradient, which
    # the fused kernels do not form, so the composite gives it (holding the scores, as PyTorch's math path).
    return Derivatives(backward, composite.attention, differentiable_inputs=(0, 1, 2), differentiable_outputs=(0, 1),
                       composite_inputs=(3,))


def _register(forward_name: str, backward_name: str) -> None:
    register_op_pair(forward_name, backward_name, _fake_forward, _fake_backward, _derivatives,
                     "attn_ext.scaled_dot_product_attention", backward_layout="g0 g1 i0 i1 i2 i3 i4 o0 o1 i5 i6 i7 i8 i9")


def compiled_kernels_present() -> bool:
    """Whether the extension defines ``attention_fwd`` (an extension built before the op existed does not)."""
    if extension_error() is not None:
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("attn_ext::attention_fwd", "CPU")
    except RuntimeError:  # no such operator
        return False


# Asked once: asking the dispatcher on every call would break torch.compile's graph.
_COMPILED_KERNELS = compiled_kernels_present()
_register("attn_ext::attention_fwd_reference", "attn_ext::attention_bwd_reference")
_register("attn_ext::attention_fwd_triton", "attn_ext::attention_bwd_triton")
if _COMPILED_KERNELS:
    _register("attn_ext::attention_fwd", "attn_ext::attention_bwd")


def _cuda_supports_call(x: Tensor, context: Mapping[str, Any]) -> Optional[str]:
    """What the hand-written CUDA attention kernels do not take: dropout (the Triton kernels have it)."""
    if context.get("dropout_p", 0.0) > 0.0:
        return "the CUDA kernels have no attention dropout (the Triton kernels have)"
    return None


def _compiled_reason(x: Tensor, context: Mapping[str, Any]) -> Optional[str]:
    if not _COMPILED_KERNELS:
        return "this build of attn_ext predates attention_fwd; rebuild the extension (pip install -e .)"
    return None


declare("scaled_dot_product_attention",
        cpp=Implementation("attention_fwd", (_compiled_reason,)),
        cuda=Implementation("attention_fwd", (_compiled_reason, bf16_tensor_core_reason, _cuda_supports_call)),
        triton=Implementation("attention_fwd_triton"),
        reference=Implementation("attention_fwd_reference"))
