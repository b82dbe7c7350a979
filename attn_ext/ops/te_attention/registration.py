"""Custom ops of translation-equivariant attention: the reference backend's ops, fake kernels, autograd, and the
backends the public op declares (the dispatch table of :mod:`attn_ext.ops.utils.dispatch`).

Public function → op → backend → kernel function::

    public function        op (torch.ops.attn_ext.)      backend    kernel functions
    ---------------------  ----------------------------  ---------  ----------------------------------------------
    te_attention           te_attention_fwd              cpp        attn_ext::cpu::te_attention_fwd_cpu
      (attention.py)                                                (csrc/cpu/te_attention.cpp),
                                                                    attn_ext::cpu::te_attention_bwd_cpu
                                                                    (csrc/cpu/te_attention_bwd.cpp)
                           te_attention_fwd_triton       triton     triton_fwd.te_attention_fwd_triton,
                                                                    triton_bwd.te_attention_bwd_triton
                           te_attention_fwd_reference    reference  naive.chunked_forward, naive.chunked_backward

The compiled op (CPU only: no CUDA kernel) is defined and implemented in C++ (``csrc/op_list.h``); the Triton and
reference ops take the same schema (:func:`~attn_ext.ops.utils.schemas.op_schema`). The reference, like the kernels,
streams the keys in chunks (memory independent of ``M·N``), so it also runs on any device. The Triton kernel
modules are imported inside the Triton backend functions: Triton is an optional dependency, and it reads
``TRITON_INTERPRET`` when a kernel is decorated (:mod:`attn_ext.ops.utils.triton`). ``te_attention_fwd`` returns
``(out, lse)``; ``te_attention_bwd`` the gradients of its nine tensors from the saved ``(out, lse)``. Derivatives
beyond the first order, forward mode and ``torch.func`` go through :mod:`.composite` (the dense formula).
"""
from __future__ import annotations

from typing import Callable

from attn_ext.ops.te_attention import composite, naive
from attn_ext.ops.te_attention.checks import check_te_attention_args
from attn_ext.ops.utils.autograd import Derivatives
from attn_ext.ops.utils.dispatch import Implementation, declare
from attn_ext.ops.utils.dtypes import accumulation_dtype
from attn_ext.ops.utils.extension import extension_error
from attn_ext.ops.utils.registration import define_op, register_op_pair

#: Keys per chunk of the reference op when the call leaves it to the op (chunk_size 0).
REFERENCE_CHUNK = 64


@define_op("attn_ext::te_attention_fwd_reference")
def te_attention_fwd_reference(q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask, scale, activation, chunk_size):
    # Direct torch.ops calls bypass the public API: check here too, as the C++ ops do.
    check_te_attention_args(q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask, scale, activation, chunk_size)
    acc = accumulation_dtype(q.dtype)
    tensors = [t.to(acc) for t in (q, k, v, xq, xk, w1, b1, w2, b2)]
    out, lse = naive.chunked_forward(*tensors, key_padding_mask, scale, naive.ACTIVATION_NAMES[activation],
                                     chunk_size or REFERENCE_CHUNK)
    return out.to(q.dtype), lse


@define_op("attn_ext::te_attention_bwd_reference")
def te_attention_bwd_reference(grad_out, grad_lse, q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask, out, lse, scale,
                               activation, chunk_size):
    check_te_attention_args(q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask, scale, activation, chunk_size)
    acc = accumulation_dtype(q.dtype)
    inputs = (q, k, v, xq, xk, w1, b1, w2, b2)
    grads = naive.chunked_backward(grad_out.to(acc), grad_lse, *[t.to(acc) for t in inputs], key_padding_mask,
                                   out.to(acc), lse, scale, naive.ACTIVATION_NAMES[activation],
                                   chunk_size or REFERENCE_CHUNK)
    return tuple(g.to(t.dtype) for g, t in zip(grads, inputs))


@define_op("attn_ext::te_attention_fwd_triton")
def te_attention_fwd_triton_op(q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask, scale, activation, chunk_size):
    check_te_attention_args(q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask, scale, activation, chunk_size)
    from attn_ext.ops.te_attention import triton_fwd  # optional dependency (Triton)

    return triton_fwd.te_attention_fwd_triton(q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask, scale, activation,
                                              chunk_size)


@define_op("attn_ext::te_attention_bwd_triton")
def te_attention_bwd_triton_op(grad_out, grad_lse, q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask, out, lse, scale,
                               activation, chunk_size):
    check_te_attention_args(q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask, scale, activation, chunk_size)
    from attn_ext.ops.te_attention import triton_bwd  # optional dependency (Triton)

    return triton_bwd.te_attention_bwd_triton(grad_out, grad_lse, q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask,
                                              out, lse, scale, activation, chunk_size)


def _fake_forward(q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask, scale, activation, chunk_size):
    B, H, M, _ = q.shape
    return q.new_empty((B, H, M, v.shape[-1])), q.new_empty((B, H, M), dtype=accumulation_dtype(q.dtype))


def _fake_backward(grad_out, grad_lse, q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask, out, lse, scale,
                   activation, chunk_size):
    return tuple(t.new_empty(t.shape) for t in (q, k, v, xq, xk, w1, b1, w2, b2))


def _derivatives(backward_op: Callable) -> Derivatives:
    def backward(inputs, outputs, grads):
        *tensors, key_padding_mask, scale, activation, chunk_size = inputs
        out, lse = outputs
        return (*backward_op(grads[0], grads[1], *tensors, key_padding_mask, out, lse, scale, activation, chunk_size),
                None, None, None, None)

    return Derivatives(backward, composite.te_attention, differentiable_inputs=tuple(range(9)),
                       differentiable_outputs=(0, 1))


def _register(forward_name: str, backward_name: str) -> None:
    register_op_pair(forward_name, backward_name, _fake_forward, _fake_backward, _derivatives,
                     "attn_ext.te_attention",
                     backward_layout="g0 g1 i0 i1 i2 i3 i4 i5 i6 i7 i8 i9 o0 o1 i10 i11 i12")


_register("attn_ext::te_attention_fwd_reference", "attn_ext::te_attention_bwd_reference")
_register("attn_ext::te_attention_fwd_triton", "attn_ext::te_attention_bwd_triton")
if extension_error() is None:
    _register("attn_ext::te_attention_fwd", "attn_ext::te_attention_bwd")


# ---- the backends of the public op (the front end dispatches through this name)

TE_ATTENTION = declare(
    "te_attention",
    cpp=Implementation("te_attention_fwd"),
    triton=Implementation(te_attention_fwd_triton_op),
    reference=Implementation(te_attention_fwd_reference))
