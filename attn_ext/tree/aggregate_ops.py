"""torch.library registrations of the fused masked-mean tree aggregation (SPEC §3 "Aggregate").

``attn_ext::tree_aggregate_fwd`` (csrc/cpu/tree_aggregate.cpp) gets a fake kernel and an autograd
formula calling ``attn_ext::tree_aggregate_bwd``. The aggregation is linear, so the backward is
its transpose and the backward's own backward is the forward again (double backward works).
"""
from __future__ import annotations

import torch
from torch import Tensor

from attn_ext._extension import extension_error


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


def _aggregate_setup_context(ctx, inputs, output):
    leaf_values, leaf_token, node_padding_mask, branching, height, group_size = inputs
    ctx.save_for_backward(leaf_token, node_padding_mask)
    ctx.tree = (branching, height, group_size)
    ctx.num_tokens = leaf_values.shape[1]


def _aggregate_backward(ctx, grad_nodes: Tensor):
    # The op's inputs do not include the tree's token_leaf (the forward has no use for it), so the
    # backward rebuilds it: O(B·L) integers, small next to the [B, L, E] payload.
    leaf_token, node_padding_mask = ctx.saved_tensors
    grad = torch.ops.attn_ext.tree_aggregate_bwd(grad_nodes, leaf_token, token_leaf_of(leaf_token, ctx.num_tokens),
                                                      node_padding_mask, *ctx.tree, ctx.num_tokens)
    return grad, None, None, None, None, None


def _aggregate_bwd_setup_context(ctx, inputs, output):
    _, leaf_token, _, node_padding_mask, branching, height, group_size, _ = inputs
    ctx.save_for_backward(leaf_token, node_padding_mask)
    ctx.tree = (branching, height, group_size)


def _aggregate_bwd_backward(ctx, grad_grad_values: Tensor):
    leaf_token, node_padding_mask = ctx.saved_tensors
    grad_grad_nodes = torch.ops.attn_ext.tree_aggregate_fwd(grad_grad_values, leaf_token, node_padding_mask,
                                                                 *ctx.tree)
    return grad_grad_nodes, None, None, None, None, None, None, None


if extension_error() is None:
    torch.library.register_fake("attn_ext::tree_aggregate_fwd")(_fake_aggregate_forward)
    torch.library.register_fake("attn_ext::tree_aggregate_bwd")(_fake_aggregate_backward)
    torch.library.register_autograd("attn_ext::tree_aggregate_fwd", _aggregate_backward,
                                    setup_context=_aggregate_setup_context)
    torch.library.register_autograd("attn_ext::tree_aggregate_bwd", _aggregate_bwd_backward,
                                    setup_context=_aggregate_bwd_setup_context)
