"""Custom ops of the tree family: the Python backends' schemas, fake kernels, autograd, and the backends
each public op has (the dispatch table of :mod:`attn_ext.ops.utils.dispatch`).

**Tree cross attention** (docs/spec.md §0, §3).

``attn_ext::tree_cross_attention_fwd`` (C++, csrc/cpu/tree_cross_attention.cpp; schemas in csrc/schemas.cpp)
returns ``(out, lse, selected, log_prob, entropy)``; ``attn_ext::tree_cross_attention_bwd``
(csrc/cpu/tree_cross_attention_bwd.cpp) returns ``(grad_q, grad_node_k, grad_node_v)`` from the
forward's ``selected`` and ``lse``, without repeating the descent. ``..._fwd_triton`` / ``..._bwd_triton``
are the same contract on the Triton kernels (:mod:`.triton_fwd`, :mod:`.triton_bwd`), defined here.
Each pair gets fake kernels (shapes only; ``S = height·(b − 1) + group_size``) for meta tensors and
torch.compile, and the forward its autograd formula.

**Aggregation** (docs/spec.md §3 "Aggregate"): ``attn_ext::tree_aggregate_fwd`` (the compiled masked mean,
one depth-first pass) gets a fake kernel and an autograd formula calling ``attn_ext::tree_aggregate_bwd``.
The aggregation is linear: the backward is its transpose and the tangent is aggregated like the values.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from attn_ext.ops.tree import composite
from attn_ext.ops.utils.autograd import Derivatives, register_derivatives
from attn_ext.ops.utils.dispatch import Implementation, declare
from attn_ext.ops.utils.dtypes import SUPPORTED_DTYPES, accumulation_dtype
from attn_ext.ops.utils.extension import extension_error
from attn_ext.ops.utils.registration import define_op, register_op_pair


def _fake_backward(grad_out, grad_lse, grad_log_prob, grad_entropy, q, node_k, node_v, node_padding_mask, selected,
                   lse, branching, height, group_size, scale):
    return q.new_empty(q.shape), node_k.new_empty(node_k.shape), node_v.new_empty(node_v.shape)


@define_op("attn_ext::tree_cross_attention_fwd_triton")
def _tree_cross_attention_fwd_triton(
    q: Tensor, node_k: Tensor, node_v: Tensor, node_padding_mask: Tensor, branching: int, height: int,
    group_size: int, scale: float, uniforms: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    from attn_ext.ops.tree.triton_fwd import tree_cross_attention_fwd_triton

    return tree_cross_attention_fwd_triton(q, node_k, node_v, node_padding_mask, branching, height, group_size, scale,
                                           uniforms)


@define_op("attn_ext::tree_cross_attention_bwd_triton")
def _tree_cross_attention_bwd_triton(
    grad_out: Tensor, grad_lse: Tensor, grad_log_prob: Tensor, grad_entropy: Tensor, q: Tensor, node_k: Tensor,
    node_v: Tensor, node_padding_mask: Tensor, selected: Tensor, lse: Tensor, branching: int, height: int,
    group_size: int, scale: float,
) -> Tuple[Tensor, Tensor, Tensor]:
    from attn_ext.ops.tree.triton_bwd import tree_cross_attention_bwd_triton

    return tree_cross_attention_bwd_triton(grad_out, grad_lse, grad_log_prob, grad_entropy, q, node_k, node_v,
                                           node_padding_mask, selected, lse, branching, height, group_size, scale)


def _fake_forward(q, node_k, node_v, node_padding_mask, branching, height, group_size, scale, uniforms):
    B, H, M, _ = q.shape
    acc = accumulation_dtype(q.dtype)
    S = height * (branching - 1) + group_size
    return (q.new_empty((B, H, M, node_v.shape[-1])), q.new_empty((B, H, M), dtype=acc),
            q.new_empty((B, M, S), dtype=torch.long), q.new_empty((B, M), dtype=acc), q.new_empty((B, M), dtype=acc))


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


# Aggregation (docs/spec.md §3 "Aggregate")

def _fake_aggregate_forward(leaf_values, leaf_token, node_padding_mask, branching, height, group_size):
    return leaf_values.new_empty((leaf_values.shape[0], node_padding_mask.shape[1], leaf_values.shape[2]))


def _fake_aggregate_backward(grad_nodes, leaf_token, token_leaf, node_padding_mask, branching, height, group_size,
                             num_tokens):
    return grad_nodes.new_empty((grad_nodes.shape[0], num_tokens, grad_nodes.shape[2]))


def token_leaf_of(leaf_token: Tensor, num_tokens: int) -> Tensor:
    """Inverse map ``[B, num_tokens]`` of ``leaf_token [B, L]`` (``-1`` at padding slots), as ``Tree.token_leaf``."""
    B, L = leaf_token.shape
    slots = torch.arange(L, device=leaf_token.device).expand(B, L)
    # The padding slots all land in an extra column, dropped afterwards.
    inverse = leaf_token.new_full((B, num_tokens + 1), -1)
    inverse.scatter_(1, torch.where(leaf_token >= 0, leaf_token, num_tokens), slots)
    return inverse[:, :num_tokens]


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


declare("tree_cross_attention", cpp=Implementation("tree_cross_attention_fwd"),
        cuda=Implementation("tree_cross_attention_fwd"), triton=Implementation("tree_cross_attention_fwd_triton"),
        reference=Implementation())
declare("tree_aggregate", cpp=Implementation("tree_aggregate_fwd", (_mean_of_floats,)),
        cuda=Implementation("tree_aggregate_fwd", (_mean_of_floats,)), reference=Implementation())
