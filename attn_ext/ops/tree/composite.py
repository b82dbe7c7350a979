"""Differentiable PyTorch compositions of the tree ops, for derivatives beyond the first order.

The fused kernels give first derivatives; second derivatives, forward-mode tangents and ``torch.func``
transforms differentiate these instead (see :mod:`attn_ext.ops.utils.autograd`). The tree descent is
discrete: its derivatives are those at the selected nodes the forward returned, which is what
:func:`~attn_ext.ops.tree.naive.path_forward` recomputes the math on.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch
from torch import Tensor

from attn_ext.ops.tree import naive
from attn_ext.ops.tree.build import Tree, token_leaf_of


def tree_cross_attention(inputs: Sequence, outputs: Sequence[Tensor]) -> Tuple[Tensor, ...]:
    """``(out, lse, log_prob, entropy)`` of ``tree_cross_attention_fwd`` on its own selected nodes."""
    q, node_k, node_v, node_padding_mask, branching, height, group_size, scale, _uniforms = inputs
    selected = outputs[2]
    return naive.path_forward(q, node_k, node_v, node_padding_mask, selected, branching, height, group_size, scale)


def tree_of(leaf_token: Tensor, node_padding_mask: Tensor, branching: int, height: int, group_size: int,
            num_tokens: int) -> Tree:
    """The :class:`Tree` that the aggregation op's arguments describe (no sort axis: it is not needed)."""
    sizes = [branching**level for level in range(height + 1)]
    offsets = torch.tensor([0] + sizes, device=leaf_token.device).cumsum(0)
    axis = torch.full((leaf_token.shape[0],), -1, dtype=torch.long, device=leaf_token.device)
    return Tree(leaf_token, token_leaf_of(leaf_token, num_tokens), node_padding_mask, offsets, axis, branching,
                height, group_size, num_tokens)


def tree_aggregate(inputs: Sequence, outputs: Sequence[Tensor]) -> Tuple[Tensor]:
    """The masked-mean aggregation of ``tree_aggregate_fwd``, level by level."""
    leaf_values, leaf_token, node_padding_mask, branching, height, group_size = inputs
    tree = tree_of(leaf_token, node_padding_mask, branching, height, group_size, leaf_values.shape[1])
    return (naive.tree_aggregate_reference(tree, leaf_values, naive.masked_mean),)


def tree_aggregate_transpose(inputs: Sequence, outputs: Sequence[Tensor]) -> Tuple[Tensor]:
    """The composite of ``tree_aggregate_bwd``: the transpose of the (linear) aggregation applied to node grads."""
    grad_nodes, leaf_token, _token_leaf, node_padding_mask, branching, height, group_size, num_tokens = inputs
    zeros = grad_nodes.new_zeros((grad_nodes.shape[0], num_tokens, grad_nodes.shape[2]))
    aggregate = lambda values: tree_aggregate((values, leaf_token, node_padding_mask, branching, height, group_size),
                                              outputs)[0]
    return (torch.func.vjp(aggregate, zeros)[1](grad_nodes)[0],)
