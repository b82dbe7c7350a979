"""Custom ops of the attention family: the Python backends' ops, fake kernels, autograd, and the backends
each public op declares (the dispatch table of :mod:`attn_ext.ops.utils.dispatch`).

Public function → op → backend → kernel function (each forward op ``<op>_fwd…`` has its backward
``<op>_bwd…``, registered as its autograd)::

    public function                op (torch.ops.attn_ext.)       backend    kernel functions
    ----------------------------   ----------------------------   --------   --------------------------------------------
    scaled_dot_product_attention   attention_fwd                  cpp        attn_ext::cpu::attention_{fwd,bwd}_cpu
      (scaled_dot_product.py);                                               (csrc/cpu/attention_ops.cpp)
      the states with attn_mask    attention_fwd                  cuda       attn_ext::cuda::attention_{fwd,bwd}_cuda
      (state.py)                                                             (csrc/cuda/bindings/attention.cpp)
                                   attention_fwd_triton           triton     triton_fwd.attention_forward,
                                                                             triton_bwd.attention_backward
                                   attention_fwd_reference        reference  naive.attention_forward, naive.attention_backward
    cross_attention (chunked.py),  cross_attention_fwd            cpp        attn_ext::cpu::cross_attention_{fwd,bwd}_cpu
      the states (state.py),       cross_attention_fwd            cuda       attn_ext::cuda::cross_attention_{fwd,bwd}_cuda
      sharded_cross_attention      cross_attention_fwd_triton     triton     triton_fwd.cross_attention_forward,
      (sharded.py)                                                           triton_bwd.cross_attention_backward
                                   cross_attention_fwd_reference  reference  naive.cross_attention_{forward,backward}
    merge_states (state.py)        merge_states_fwd               cpp, cuda  csrc/cpu/merge_states.cpp, csrc/cuda/bindings/
                                   merge_states_fwd_triton        triton     triton_merge.merge_states_{forward,backward}
                                   merge_states_fwd_reference     reference  naive.merge_states_{forward,backward}

``cross_attention_fwd`` is ``attention_fwd`` without attention mask, causal rule, dropout or grouped heads:
the same kernels with those flags off (Triton: the constexpr flags of :mod:`.triton_pairs`). The compiled
ops (cpp for CPU tensors, cuda for CUDA tensors) are defined and implemented in C++ (``csrc/op_list.h``);
the Python backends' ops below take the same schemas (:func:`~attn_ext.ops.utils.schemas.op_schema`).

Every backend of an op shares one autograd formula: the backward op of the same backend is called with the
saved inputs and the final ``(out, lse)``, so no ``[L, S]`` matrix is kept between the passes. Higher
derivatives, forward mode and ``torch.func`` differentiate :mod:`.composite` instead
(:mod:`attn_ext.ops.utils.autograd`).

The Triton kernel modules are imported inside the Triton backend functions: Triton is an optional
dependency, and it reads ``TRITON_INTERPRET`` when a kernel is decorated, so they load on the first
Triton call (:mod:`attn_ext.ops.utils.triton`).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Tuple

import torch
from torch import Tensor

from attn_ext.ops.attention import composite
from attn_ext.ops.attention import naive as reference
from attn_ext.ops.attention.band import Band, check_band_args
from attn_ext.ops.attention.packed import check_packed_args, packed_backward, packed_forward
from attn_ext.ops.attention.score_mod import check_score_mod_args
from attn_ext.ops.utils.autograd import Derivatives
from attn_ext.ops.utils.cuda_capability import bf16_tensor_core_reason
from attn_ext.ops.utils.dispatch import Implementation, declare
from attn_ext.ops.utils.dtypes import accumulation_dtype
from attn_ext.ops.utils.extension import extension_error
from attn_ext.ops.utils.registration import define_op, register_op_pair
from attn_ext.ops.utils.score_range import check_scores_in_range
from attn_ext.ops.utils.validation import check_cross_attention_args

_BwdResult = Tuple[Tensor, Tensor, Tensor]


# ---- attention_fwd: attention mask, causal order, dropout, grouped key/value heads


def _reference_forward(q, k, v, attn_mask, key_padding_mask, scale, is_causal, dropout_p, dropout_seed, chunk_size,
                       window_left, window_right, diagonal, softcap, alibi_slopes):
    out, lse = reference.attention_forward(q, k, v, attn_mask, key_padding_mask, scale, is_causal, dropout_p,
                                           dropout_seed, chunk_size, window_left, window_right, diagonal, softcap,
                                           alibi_slopes)
    check_scores_in_range("scaled_dot_product_attention", q, k, v, out, lse, scale, attn_mask, key_padding_mask,
                          Band.of(is_causal, window_left, window_right, diagonal))
    return out, lse


@define_op("attn_ext::attention_fwd_reference")
def attention_fwd_reference(q, k, v, attn_mask, key_padding_mask, scale, is_causal, dropout_p, dropout_seed,
                            chunk_size, window_left=-1, window_right=-1, diagonal=0, softcap=0.0, alibi_slopes=None,
                            cu_seqlens_q=None, cu_seqlens_k=None, bottom_right=False):
    check_band_args(window_left, window_right, diagonal)
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        check_packed_args(q, diagonal, dropout_p, attn_mask, key_padding_mask)
        check_score_mod_args(softcap, alibi_slopes, cu_seqlens_q.numel() - 1, q.shape[1], q.device)
        return packed_forward(_reference_forward, q, k, v, scale, is_causal, chunk_size, window_left, window_right,
                              softcap, alibi_slopes, cu_seqlens_q, cu_seqlens_k, bottom_right)
    check_score_mod_args(softcap, alibi_slopes, q.shape[0], q.shape[1], q.device)
    return _reference_forward(q, k, v, attn_mask, key_padding_mask, scale, is_causal, dropout_p, dropout_seed,
                              chunk_size, window_left, window_right, diagonal, softcap, alibi_slopes)


@define_op("attn_ext::attention_bwd_reference")
def attention_bwd_reference(grad_out, grad_lse, q, k, v, attn_mask, key_padding_mask, out, lse, scale, is_causal,
                            dropout_p, dropout_seed, chunk_size, window_left=-1, window_right=-1, diagonal=0,
                            softcap=0.0, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None, bottom_right=False):
    check_band_args(window_left, window_right, diagonal)
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        check_packed_args(q, diagonal, dropout_p, attn_mask, key_padding_mask)
        check_score_mod_args(softcap, alibi_slopes, cu_seqlens_q.numel() - 1, q.shape[1], q.device)
        return packed_backward(reference.attention_backward, grad_out, grad_lse, q, k, v, out, lse, scale, is_causal,
                               chunk_size, window_left, window_right, softcap, alibi_slopes, cu_seqlens_q,
                               cu_seqlens_k, bottom_right)
    check_score_mod_args(softcap, alibi_slopes, q.shape[0], q.shape[1], q.device)
    return reference.attention_backward(grad_out, grad_lse, q, k, v, attn_mask, key_padding_mask, out, lse, scale,
                                        is_causal, dropout_p, dropout_seed, chunk_size, window_left, window_right,
                                        diagonal, softcap, alibi_slopes)


#: The backends whose kernels take a packed batch (``cu_seqlens_q/k``; ``ae.varlen_attention`` runs the others one
#: call per sequence): all of them (the CUDA kernels since csrc/cuda/common/packed_sequences.h).
PACKED_BACKENDS = ("cpp", "cuda", "reference", "triton")


def _checked_packed(q, diagonal, dropout_p, attn_mask, key_padding_mask, cu_seqlens_q, cu_seqlens_k) -> int:
    """The batch size of a call as ALiBi's slopes count it: the packed sequences (their offsets are checked where
    the Triton launchers read them, triton_varlen.packed_call), or ``q``'s batch."""
    if cu_seqlens_q is None and cu_seqlens_k is None:
        return q.shape[0]
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise ValueError("attn_ext.varlen_attention: a packed batch needs both cu_seqlens_q and cu_seqlens_k")
    check_packed_args(q, diagonal, dropout_p, attn_mask, key_padding_mask)
    return cu_seqlens_q.numel() - 1


@define_op("attn_ext::attention_fwd_triton")
def attention_fwd_triton(q, k, v, attn_mask, key_padding_mask, scale, is_causal, dropout_p, dropout_seed,
                         chunk_size, window_left=-1, window_right=-1, diagonal=0, softcap=0.0, alibi_slopes=None,
                         cu_seqlens_q=None, cu_seqlens_k=None, bottom_right=False):
    from attn_ext.ops.attention import triton_fwd  # optional dependency: see the module docstring

    check_band_args(window_left, window_right, diagonal)
    batch = _checked_packed(q, diagonal, dropout_p, attn_mask, key_padding_mask, cu_seqlens_q, cu_seqlens_k)
    check_score_mod_args(softcap, alibi_slopes, batch, q.shape[1], q.device)
    return triton_fwd.attention_forward(q, k, v, attn_mask, key_padding_mask, scale, is_causal, dropout_p,
                                        dropout_seed, chunk_size, window_left, window_right, diagonal, softcap,
                                        alibi_slopes, cu_seqlens_q, cu_seqlens_k, bottom_right)


@define_op("attn_ext::attention_bwd_triton")
def attention_bwd_triton(grad_out, grad_lse, q, k, v, attn_mask, key_padding_mask, out, lse, scale, is_causal,
                         dropout_p, dropout_seed, chunk_size, window_left=-1, window_right=-1, diagonal=0,
                         softcap=0.0, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None, bottom_right=False):
    from attn_ext.ops.attention import triton_bwd  # optional dependency: see the module docstring

    check_band_args(window_left, window_right, diagonal)
    batch = _checked_packed(q, diagonal, dropout_p, attn_mask, key_padding_mask, cu_seqlens_q, cu_seqlens_k)
    check_score_mod_args(softcap, alibi_slopes, batch, q.shape[1], q.device)
    return triton_bwd.attention_backward(grad_out, grad_lse, q, k, v, attn_mask, key_padding_mask, out, lse, scale,
                                         is_causal, dropout_p, dropout_seed, chunk_size, window_left, window_right,
                                         diagonal, softcap, alibi_slopes, cu_seqlens_q, cu_seqlens_k, bottom_right)


def _fake_attention(q, k, v, attn_mask, key_padding_mask, scale, is_causal, dropout_p, dropout_seed, chunk_size,
                    window_left=-1, window_right=-1, diagonal=0, softcap=0.0, alibi_slopes=None, cu_seqlens_q=None,
                    cu_seqlens_k=None, bottom_right=False):
    B, H, L, _ = q.shape
    return q.new_empty((B, H, L, v.shape[-1])), q.new_empty((B, H, L), dtype=accumulation_dtype(q.dtype))


def _fake_attention_backward(grad_out, grad_lse, q, k, v, *_rest):
    # Every backend returns contiguous gradients whatever the inputs' strides (empty_like would copy them).
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _attention_derivatives(backward_op: Callable[..., _BwdResult]) -> Derivatives:
    def backward(inputs, outputs, grads):
        q, k, v, attn_mask, key_padding_mask, scale, is_causal, dropout_p, dropout_seed, chunk_size = inputs[:10]
        out, lse = outputs
        grad_q, grad_k, grad_v = backward_op(grads[0], grads[1], q, k, v, attn_mask, key_padding_mask, out, lse,
                                             scale, is_causal, dropout_p, dropout_seed, chunk_size, *inputs[10:])
        return (grad_q, grad_k, grad_v) + (None,) * (len(inputs) - 3)

    # A float attn_mask is differentiable too, in both modes. The public function's first-order reverse mode takes
    # the chunked rule of bias_grad.py (op attention_bwd_bias); a call reaching this op with the mask differentiated
    # (higher orders, forward mode, torch.func, torch.compile) gets the composite's derivatives.
    return Derivatives(backward, composite.attention, differentiable_inputs=(0, 1, 2), differentiable_outputs=(0, 1),
                       composite_inputs=(3,))


def _register_attention(forward_name: str, backward_name: str) -> None:
    register_op_pair(forward_name, backward_name, _fake_attention, _fake_attention_backward, _attention_derivatives,
                     "attn_ext.scaled_dot_product_attention",
                     backward_layout="g0 g1 i0 i1 i2 i3 i4 o0 o1 i5 i6 i7 i8 i9 i10 i11 i12 i13 i14 i15 i16 i17")


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
_register_attention("attn_ext::attention_fwd_reference", "attn_ext::attention_bwd_reference")
_register_attention("attn_ext::attention_fwd_triton", "attn_ext::attention_bwd_triton")
if _COMPILED_KERNELS:
    _register_attention("attn_ext::attention_fwd", "attn_ext::attention_bwd")


def _cuda_supports_call(x: Tensor, context: Mapping[str, Any]) -> Optional[str]:
    """What the hand-written CUDA attention kernels do not take: dropout (the Triton kernels have it)."""
    if context.get("dropout_p", 0.0) > 0.0:
        return "the CUDA kernels have no attention dropout (the Triton kernels have)"
    return None


def _compiled_reason(x: Tensor, context: Mapping[str, Any]) -> Optional[str]:
    if not _COMPILED_KERNELS:
        return "this build of attn_ext predates attention_fwd; rebuild the extension (pip install -e .)"
    return None


# ---- cross_attention_fwd: key padding as the only rule


@define_op("attn_ext::cross_attention_fwd_reference")
def cross_attention_fwd_reference(q, k, v, key_padding_mask, scale, chunk_size):
    # Direct torch.ops calls bypass the public API: check here too, as the C++ ops do.
    check_cross_attention_args(q, k, v, key_padding_mask, scale, chunk_size, op="cross_attention")
    out, lse = reference.cross_attention_forward(q, k, v, key_padding_mask, scale, chunk_size)
    check_scores_in_range("cross_attention", q, k, v, out, lse, scale, key_padding_mask=key_padding_mask)
    return out, lse


@define_op("attn_ext::cross_attention_bwd_reference")
def cross_attention_bwd_reference(grad_out, grad_lse, q, k, v, key_padding_mask, out, lse, scale, chunk_size):
    check_cross_attention_args(q, k, v, key_padding_mask, scale, chunk_size, op="cross_attention")
    return reference.cross_attention_backward(grad_out, grad_lse, q, k, v, key_padding_mask, out, lse, scale,
                                              chunk_size)


@define_op("attn_ext::cross_attention_fwd_triton")
def cross_attention_fwd_triton(q, k, v, key_padding_mask, scale, chunk_size):
    from attn_ext.ops.attention import triton_fwd  # optional dependency: see the module docstring

    return triton_fwd.cross_attention_forward(q, k, v, key_padding_mask, scale, chunk_size)


@define_op("attn_ext::cross_attention_bwd_triton")
def cross_attention_bwd_triton(grad_out, grad_lse, q, k, v, key_padding_mask, out, lse, scale, chunk_size):
    from attn_ext.ops.attention import triton_bwd  # optional dependency: see the module docstring

    return triton_bwd.cross_attention_backward(grad_out, grad_lse, q, k, v, key_padding_mask, out, lse, scale,
                                               chunk_size)


def _fake_cross_attention(q, k, v, key_padding_mask, scale, chunk_size):
    B, H, M, _ = q.shape
    return q.new_empty((B, H, M, v.shape[-1])), q.new_empty((B, H, M), dtype=accumulation_dtype(q.dtype))


def _cross_attention_derivatives(backward_op: Callable[..., _BwdResult]) -> Derivatives:
    def backward(inputs, outputs, grads):
        q, k, v, key_padding_mask, scale, chunk_size = inputs
        out, lse = outputs
        grad_q, grad_k, grad_v = backward_op(grads[0], grads[1], q, k, v, key_padding_mask, out, lse, scale,
                                             chunk_size)
        return grad_q, grad_k, grad_v, None, None, None

    return Derivatives(backward, composite.cross_attention, differentiable_inputs=(0, 1, 2),
                       differentiable_outputs=(0, 1))


def _register_cross_attention(forward_name: str, backward_name: str) -> None:
    register_op_pair(forward_name, backward_name, _fake_cross_attention, _fake_attention_backward,
                     _cross_attention_derivatives, "attn_ext.cross_attention",
                     backward_layout="g0 g1 i0 i1 i2 i3 o0 o1 i4 i5")


_register_cross_attention("attn_ext::cross_attention_fwd_reference", "attn_ext::cross_attention_bwd_reference")
_register_cross_attention("attn_ext::cross_attention_fwd_triton", "attn_ext::cross_attention_bwd_triton")
if extension_error() is None:
    _register_cross_attention("attn_ext::cross_attention_fwd", "attn_ext::cross_attention_bwd")


# ---- merge_states_fwd: (out_a, lse_a, out_b, lse_b) -> (out, lse), the state of a union of key sets


@define_op("attn_ext::merge_states_fwd_reference")
def merge_states_fwd_reference(out_a, lse_a, out_b, lse_b):
    return reference.merge_states_forward(out_a, lse_a, out_b, lse_b)


@define_op("attn_ext::merge_states_bwd_reference")
def merge_states_bwd_reference(grad_out, grad_lse, out_a, lse_a, out_b, lse_b, out, lse):
    return reference.merge_states_backward(grad_out, grad_lse, out_a, lse_a, out_b, lse_b, out, lse)


@define_op("attn_ext::merge_states_fwd_triton")
def merge_states_fwd_triton(out_a, lse_a, out_b, lse_b):
    from attn_ext.ops.attention import triton_merge  # optional dependency: see the module docstring

    return triton_merge.merge_states_forward(out_a, lse_a, out_b, lse_b)


@define_op("attn_ext::merge_states_bwd_triton")
def merge_states_bwd_triton(grad_out, grad_lse, out_a, lse_a, out_b, lse_b, out, lse):
    from attn_ext.ops.attention import triton_merge  # optional dependency: see the module docstring

    return triton_merge.merge_states_backward(grad_out, grad_lse, out_a, lse_a, out_b, lse_b, out, lse)


def _fake_merge(out_a, lse_a, out_b, lse_b):
    return out_a.new_empty(out_a.shape), lse_a.new_empty(lse_a.shape)


def _fake_merge_backward(grad_out, grad_lse, out_a, lse_a, out_b, lse_b, out, lse):
    return (out_a.new_empty(out_a.shape), lse_a.new_empty(lse_a.shape), out_b.new_empty(out_b.shape),
            lse_b.new_empty(lse_b.shape))


def _merge_derivatives(backward_op: Callable[..., Tuple[Tensor, Tensor, Tensor, Tensor]]) -> Derivatives:
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


# ---- the backends of each public op (the front ends dispatch through these names)

SCALED_DOT_PRODUCT_ATTENTION = declare(
    "scaled_dot_product_attention",
    cpp=Implementation("attention_fwd", (_compiled_reason,)),
    cuda=Implementation("attention_fwd", (_compiled_reason, bf16_tensor_core_reason, _cuda_supports_call)),
    triton=Implementation(attention_fwd_triton),
    reference=Implementation(attention_fwd_reference))
CROSS_ATTENTION = declare(
    "cross_attention",
    cpp=Implementation("cross_attention_fwd"),
    cuda=Implementation("cross_attention_fwd", (bf16_tensor_core_reason,)),
    triton=Implementation(cross_attention_fwd_triton),
    reference=Implementation(cross_attention_fwd_reference))
MERGE_STATES = declare(
    "merge_states",
    cpp=Implementation("merge_states_fwd"),
    cuda=Implementation("merge_states_fwd"),
    triton=Implementation(merge_states_fwd_triton),
    reference=Implementation(merge_states_fwd_reference))
