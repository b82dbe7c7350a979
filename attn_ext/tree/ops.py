"""torch.library registrations of the fused Tree Cross Attention ops (SPEC §0, §3).

``attn_ext::tree_cross_attention_fwd`` (C++, csrc/cpu/tree_cross_attention.cpp; schema in csrc/ops.cpp)
returns ``(out, lse, selected, log_prob, entropy)``. It gets here

* a fake kernel (shapes only; ``S = height·(b − 1) + group_size``), for meta tensors and torch.compile;
* an autograd formula without any C++ backward: ``attn_ext::tree_cross_attention_bwd_reference``
  reruns the reference math (:func:`attn_ext.tree.retrieval.path_forward`) on the *selected* nodes
  only — the path is read back from ``selected`` — and differentiates it with autograd. That is
  O(M·|S|·D) work and gives exactly the reference's gradients (the discrete choices are constants).

``attn_ext::tree_aggregate_mean_fwd`` (csrc/cpu/tree_aggregate.cpp) gets a fake kernel and an autograd
formula calling ``attn_ext::tree_aggregate_mean_bwd``. The aggregation is linear, so the backward is
its transpose and the backward's own backward is the forward again (double backward works).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from attn_ext._extension import extension_error
from attn_ext.tree.retrieval import path_forward

_Grads = Tuple[Tensor, Tensor, Tensor]


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.custom_op("attn_ext::tree_cross_attention_bwd_reference", mutates_args=())
def _tree_cross_attention_bwd_reference(
    grad_out: Tensor, grad_lse: Tensor, grad_log_prob: Tensor, grad_entropy: Tensor, q: Tensor, node_k: Tensor,
    node_v: Tensor, node_padding_mask: Tensor, selected: Tensor, branching: int, height: int, group_size: int,
    scale: float,
) -> _Grads:
    # A custom op's implementation runs below autograd (its dispatch keys are excluded in TLS), so
    # enable_grad alone records nothing: re-admit the autograd keys for this local recomputation.
    key = torch._C.DispatchKey
    with torch._C._SetExcludeDispatchKeyGuard(key.AutogradFunctionality, False), \
            torch._C._SetExcludeDispatchKeyGuard(key.ADInplaceOrView, False), torch.enable_grad():
        inputs = [t.detach().requires_grad_() for t in (q, node_k, node_v)]
        outputs = path_forward(*inputs, node_padding_mask, selected, branching, height, group_size, scale)
        grads = torch.autograd.grad(outputs, inputs, (grad_out, grad_lse, grad_log_prob, grad_entropy),
                                    allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g.contiguous() for g, t in zip(grads, (q, node_k, node_v)))


@torch.library.register_fake("attn_ext::tree_cross_attention_bwd_reference")
def _fake_backward(grad_out, grad_lse, grad_log_prob, grad_entropy, q, node_k, node_v, node_padding_mask, selected,
                   branching, height, group_size, scale):
    return q.new_empty(q.shape), node_k.new_empty(node_k.shape), node_v.new_empty(node_v.shape)


def _fake_forward(q, node_k, node_v, node_padding_mask, branching, height, group_size, scale, uniforms):
    B, H, M, _ = q.shape
    acc = _accumulation_dtype(q.dtype)
    S = height * (branching - 1) + group_size
    return (q.new_empty((B, H, M, node_v.shape[-1])), q.new_empty((B, H, M), dtype=acc),
            q.new_empty((B, M, S), dtype=torch.long), q.new_empty((B, M), dtype=acc), q.new_empty((B, M), dtype=acc))


def _setup_context(ctx, inputs, output):
    q, node_k, node_v, node_padding_mask, branching, height, group_size, scale, _ = inputs
    out, lse, selected, log_prob, entropy = output
    ctx.save_for_backward(q, node_k, node_v, node_padding_mask, selected, out, lse, log_prob)
    ctx.tree = (branching, height, group_size, scale)


def _backward(ctx, grad_out: Optional[Tensor], grad_lse: Optional[Tensor], grad_selected, grad_log_prob:
              Optional[Tensor], grad_entropy: Optional[Tensor]):
    q, node_k, node_v, node_padding_mask, selected, out, lse, log_prob = ctx.saved_tensors
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
    grad_log_prob = torch.zeros_like(log_prob) if grad_log_prob is None else grad_log_prob
    grad_entropy = torch.zeros_like(log_prob) if grad_entropy is None else grad_entropy
    grad_q, grad_k, grad_v = torch.ops.attn_ext.tree_cross_attention_bwd_reference(
        grad_out, grad_lse, grad_log_prob, grad_entropy, q, node_k, node_v, node_padding_mask, selected, *ctx.tree
    )
    return grad_q, grad_k, grad_v, None, None, None, None, None, None


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
    grad = torch.ops.attn_ext.tree_aggregate_mean_bwd(grad_nodes, leaf_token, token_leaf_of(leaf_token, ctx.num_tokens),
                                                      node_padding_mask, *ctx.tree, ctx.num_tokens)
    return grad, None, None, None, None, None


def _aggregate_bwd_setup_context(ctx, inputs, output):
    _, leaf_token, _, node_padding_mask, branching, height, group_size, _ = inputs
    ctx.save_for_backward(leaf_token, node_padding_mask)
    ctx.tree = (branching, height, group_size)


def _aggregate_bwd_backward(ctx, grad_grad_values: Tensor):
    leaf_token, node_padding_mask = ctx.saved_tensors
    grad_grad_nodes = torch.ops.attn_ext.tree_aggregate_mean_fwd(grad_grad_values, leaf_token, node_padding_mask,
                                                                 *ctx.tree)
    return grad_grad_nodes, None, None, None, None, None, None, None


if extension_error() is None:
    torch.library.register_fake("attn_ext::tree_cross_attention_fwd")(_fake_forward)
    torch.library.register_autograd("attn_ext::tree_cross_attention_fwd", _backward, setup_context=_setup_context)
    torch.library.register_fake("attn_ext::tree_aggregate_mean_fwd")(_fake_aggregate_forward)
    torch.library.register_fake("attn_ext::tree_aggregate_mean_bwd")(_fake_aggregate_backward)
    torch.library.register_autograd("attn_ext::tree_aggregate_mean_fwd", _aggregate_backward,
                                    setup_context=_aggregate_setup_context)
    torch.library.register_autograd("attn_ext::tree_aggregate_mean_bwd", _aggregate_bwd_backward,
                                    setup_context=_aggregate_bwd_setup_context)
