"""Custom ops of the tree family: the Python backends' ops, fake kernels, autograd, and the backends each
public op declares (the dispatch table of :mod:`attn_ext.ops.utils.dispatch`).

Public function → op → backend → kernel function (each forward op ``<op>_fwd…`` has its backward
``<op>_bwd…``, registered as its autograd)::

    public function        op (torch.ops.attn_ext.)         backend    kernel functions
    --------------------   -------------------------------  ---------  ------------------------------------------------
    tree_cross_attention   tree_cross_attention_fwd         cpp        attn_ext::cpu::tree_cross_attention_fwd_cpu
      (retrieval.py)                                                   (csrc/cpu/tree_cross_attention.cpp),
                                                                       attn_ext::cpu::tree_cross_attention_bwd_cpu
                                                                       (csrc/cpu/tree_cross_attention_bwd.cpp)
                           tree_cross_attention_fwd         cuda       attn_ext::cuda::tree_cross_attention_fwd_cuda,
                                                                       attn_ext::cuda::tree_cross_attention_bwd_cuda
                                                                       (csrc/cuda/bindings/tree.cpp)
                           tree_cross_attention_fwd_triton  triton     triton_fwd.tree_cross_attention_fwd_triton,
                                                                       triton_bwd.tree_cross_attention_bwd_triton
                           — (PyTorch code)                 reference  naive.tree_cross_attention_reference
    tree_aggregate         tree_aggregate_fwd               cpp        attn_ext::cpu::tree_aggregate_{fwd,bwd}_cpu
      (aggregate.py)                                                   (csrc/cpu/tree_aggregate.cpp)
                           tree_aggregate_fwd               cuda       attn_ext::cuda::tree_aggregate_{fwd,bwd}_cuda
                                                                       (csrc/cuda/bindings/tree.cpp)
                           — (PyTorch code)                 reference  naive.tree_aggregate_reference

With ``policy="full"`` the fused backends of ``tree_cross_attention`` run :func:`attn_ext.cross_attention`
over the leaves instead (the attention family's ops). The compiled ops (cpp for CPU tensors, cuda for CUDA
tensors) are defined and implemented in C++ (``csrc/op_list.h``); the Triton backend's ops below take the
same schemas (:func:`~attn_ext.ops.utils.schemas.op_schema`).

**Tree cross attention** (docs/spec.md §0, §3). ``tree_cross_attention_fwd`` returns
``(out, lse, selected, log_prob, entropy)``; ``tree_cross_attention_bwd`` returns
``(grad_q, grad_node_k, grad_node_v)`` from the forward's ``selected`` and ``lse``, without repeating the
descent. Each pair gets fake kernels (shapes only; ``S = height·(b − 1) + group_size``) for meta tensors
and torch.compile, and the forward its autograd formula.

**Aggregation** (docs/spec.md §3 "Aggregate"): ``tree_aggregate_fwd`` (the compiled masked mean, one
depth-first pass) gets a fake kernel and an autograd formula calling ``tree_aggregate_bwd``. The
aggregation is linear: the backward is its transpose and the tangent is aggregated like the values.

The Triton kernel modules are imported inside the Triton backend functions: Triton is an optional
dependency, and it reads ``TRITON_INTERPRET`` when a kernel is decorated, so they load on the first
Triton call (:mod:`attn_ext.ops.utils.triton`).
"""
from __future__ import annotations

from typing import Callable, Tuple

import torch
from torch import Tensor

from attn_ext.ops.tree import composite
from attn_ext.ops.tree.build import token_leaf_of
from attn_ext.ops.utils.autograd import Derivatives, register_derivatives
from attn_ext.ops.utils.dispatch import Implementation, declare
from attn_ext.ops.utils.dtypes import SUPPORTED_DTYPES, accumulation_dtype
from attn_ext.ops.utils.extension import extension_error
from attn_ext.ops.utils.registration import define_op, register_op_pair


# ---- tree_cross_attention_fwd: each query descends the tree and attends over the nodes it selected


@define_op("attn_ext::tree_cross_attention_fwd_triton")
def tree_cross_attention_fwd_triton_op(q, node_k, node_v, node_padding_mask, branching, height, group_size, scale,
                                       uniforms):
    from attn_ext.ops.tree import triton_fwd  # optional dependency (Triton)

    return triton_fwd.tree_cross_attention_fwd_triton(q, node_k, node_v, node_padding_mask, branching, height,
                                                      group_size, scale, uniforms)


@define_op("attn_ext::tree_cross_attention_bwd_triton")
def tree_cross_attention_bwd_triton_op(grad_out, grad_lse, grad_log_prob, grad_entropy, q, node_k, node_v,
                                       node_padding_mask, selected, lse, branching, height, group_size, scale):
    from attn_ext.ops.tree import triton_bwd  # optional dependency (Triton)

    return triton_bwd.tree_cross_attention_bwd_triton(grad_out, grad_lse, grad_log_prob, grad_entropy, q, node_k,
                                                      node_v, node_padding_mask, selected, lse, branching, height,
                                                      group_size, scale)


def _fake_forward(q, node_k, node_v, node_padding_mask, branching, height, group_size, scale, uniforms):
    B, H, M, _ = q.shape
    acc = accumulation_dtype(q.dtype)
    S = height * (branching - 1) + group_size
    return (q.new_empty((B, H, M, node_v.shape[-1])), q.new_empty((B, H, M), dtype=acc),
            q.new_empty((B, M, S), dtype=torch.long), q.new_empty((B, M), dtype=acc), q.new_empty((B, M), dtype=acc))


def _fake_backward(grad_out, grad_lse, grad_log_prob, grad_entropy, q, node_k, node_v, node_padding_mask, selected,
                   lse, branching, height, group_size, scale):
    return q.new_empty(q.shape), node_k.new_empty(node_k.shape), node_v.new_empty(node_v.shape)


def _derivatives(backward_op: Callable[..., Tuple[Tensor, Tensor, Tensor]]) -> Derivatives:
    def backward(inputs, outputs, grads):
        q, node_k, node_v, node_padding_mask, branching, height, group_size, scale, _ = inputs
        _, lse, selected, _, _ = outputs
        grad_q, grad_k, grad_v = backward_op(*grads, q, node_k, node_v, node_padding_mask, selected, lse, branching,
                                             height, group_size, scale)
        return grad_q, grad_k, grad_v, None, None, None, None, None, None

    return Derivatives(backward, composite.tree_cross_attention, differentiable_inputs=(0, 1, 2),
                       differentiable_outputs=(0, 1, 3, 4))


def _register(forward_name: str, backward_name: str) -> None:
    register_op_pair(forward_name, backward_name, _fake_forward, _fake_backward, _derivatives,
                     "attn_ext.tree_cross_attention", backward_layout="g0 g1 g3 g4 i0 i1 i2 i3 o2 o1 i4 i5 i6 i7")


_register("attn_ext::tree_cross_attention_fwd_triton", "attn_ext::tree_cross_attention_bwd_triton")
if extension_error() is None:
    _register("attn_ext::tree_cross_attention_fwd", "attn_ext::tree_cross_attention_bwd")


# ---- tree_aggregate_fwd: node values, the masked mean of their children (docs/spec.md §3 "Aggregate")


def _fake_aggregate_forward(leaf_values, leaf_token, node_padding_mask, branching, height, group_size):
    return leaf_values.new_empty((leaf_values.shape[0], node_padding_mask.shape[1], leaf_values.shape[2]))


def _fake_aggregate_backward(grad_nodes, leaf_token, token_leaf, node_padding_mask, branching, height, group_size,
                             num_tokens):
    return grad_nodes.new_empty((grad_nodes.shape[0], num_tokens, grad_nodes.shape[2]))


def _aggregate_derivatives(backward_op) -> Derivatives:
    def backward(inputs, outputs, grads):
        # The op's inputs do not include the tree's token_leaf (the forward has no use for it), so the
        # backward rebuilds it: O(B·L) integers, small next to the [B, L, E] payload.
        leaf_values, leaf_token, node_padding_mask, branching, height, group_size = inputs
        num_tokens = leaf_values.shape[1]
        grad = backward_op(grads[0], leaf_token, token_leaf_of(leaf_token, num_tokens), node_padding_mask, branching,
                           height, group_size, num_tokens)
        return grad, None, None, None, None, None

    def jvp(inputs, outputs, tangents):  # linear in the values: the tangent is aggregated like them
        _, leaf_token, node_padding_mask, branching, height, group_size = inputs
        return (torch.ops.attn_ext.tree_aggregate_fwd(tangents[0], leaf_token, node_padding_mask, branching, height,
                                                      group_size),)

    return Derivatives(backward, composite.tree_aggregate, differentiable_inputs=(0,), differentiable_outputs=(0,),
                       jvp=jvp)


def _aggregate_transpose_derivatives() -> Derivatives:
    """The backward op is the transpose of a linear map: its own backward is the forward op."""
    def backward(inputs, outputs, grads):
        _, leaf_token, _, node_padding_mask, branching, height, group_size, _ = inputs
        grad = torch.ops.attn_ext.tree_aggregate_fwd(grads[0], leaf_token, node_padding_mask, branching, height,
                                                     group_size)
        return grad, None, None, None, None, None, None, None

    def jvp(inputs, outputs, tangents):
        return (torch.ops.attn_ext.tree_aggregate_bwd(tangents[0], *inputs[1:]),)

    return Derivatives(backward, composite.tree_aggregate_transpose, differentiable_inputs=(0,),
                       differentiable_outputs=(0,), jvp=jvp)


if extension_error() is None:
    torch.library.register_fake("attn_ext::tree_aggregate_fwd")(_fake_aggregate_forward)
    torch.library.register_fake("attn_ext::tree_aggregate_bwd")(_fake_aggregate_backward)
    register_derivatives("attn_ext::tree_aggregate_fwd", _aggregate_derivatives(torch.ops.attn_ext.tree_aggregate_bwd),
                         "attn_ext.tree_aggregate")
    register_derivatives("attn_ext::tree_aggregate_bwd", _aggregate_transpose_derivatives(), "attn_ext.tree_aggregate")


def _mean_of_floats(x, context):
    if not isinstance(context.get("reduce", "mean"), str):
        return "the compiled kernel runs reduce='mean' only, not a callable"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"the compiled kernel takes float16, bfloat16, float32 or float64, not {x.dtype}"
    return None


# ---- the backends of each public op (the front ends dispatch through these names)

TREE_CROSS_ATTENTION = declare(
    "tree_cross_attention",
    cpp=Implementation("tree_cross_attention_fwd"),
    cuda=Implementation("tree_cross_attention_fwd"),
    triton=Implementation(tree_cross_attention_fwd_triton_op),
    reference=Implementation())
TREE_AGGREGATE = declare(
    "tree_aggregate",
    cpp=Implementation("tree_aggregate_fwd", (_mean_of_floats,)),
    cuda=Implementation("tree_aggregate_fwd", (_mean_of_floats,)),
    reference=Implementation())  # no Triton kernel
