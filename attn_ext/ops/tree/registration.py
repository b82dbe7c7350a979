"""torch.library registrations of the fused Tree Cross Attention ops (SPEC §0, §3).

``attn_ext::tree_cross_attention_fwd`` (C++, csrc/cpu/tree_cross_attention.cpp; schemas in csrc/ops.cpp)
returns ``(out, lse, selected, log_prob, entropy)``; ``attn_ext::tree_cross_attention_bwd``
(csrc/cpu/tree_cross_attention_bwd.cpp) returns ``(grad_q, grad_node_k, grad_node_v)`` from the
forward's ``selected`` and ``lse``, without repeating the descent. ``..._fwd_triton`` / ``..._bwd_triton``
are the same contract on the Triton kernels (attn_ext/triton/tree_cross_attention*.py), defined here.
Each pair gets fake kernels (shapes only; ``S = height·(b − 1) + group_size``) for meta tensors and
torch.compile, and the forward its autograd formula.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from attn_ext._extension import extension_error
from attn_ext._registration import register_op_pair


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fake_backward(grad_out, grad_lse, grad_log_prob, grad_entropy, q, node_k, node_v, node_padding_mask, selected,
                   lse, branching, height, group_size, scale):
    return q.new_empty(q.shape), node_k.new_empty(node_k.shape), node_v.new_empty(node_v.shape)


@torch.library.custom_op("attn_ext::tree_cross_attention_fwd_triton", mutates_args=())
def _tree_cross_attention_fwd_triton(
    q: Tensor, node_k: Tensor, node_v: Tensor, node_padding_mask: Tensor, branching: int, height: int,
    group_size: int, scale: float, uniforms: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    from attn_ext.triton.tree_cross_attention import tree_cross_attention_fwd_triton

    return tree_cross_attention_fwd_triton(q, node_k, node_v, node_padding_mask, branching, height, group_size, scale,
                                           uniforms)


@torch.library.custom_op("attn_ext::tree_cross_attention_bwd_triton", mutates_args=())
def _tree_cross_attention_bwd_triton(
    grad_out: Tensor, grad_lse: Tensor, grad_log_prob: Tensor, grad_entropy: Tensor, q: Tensor, node_k: Tensor,
    node_v: Tensor, node_padding_mask: Tensor, selected: Tensor, lse: Tensor, branching: int, height: int,
    group_size: int, scale: float,
) -> Tuple[Tensor, Tensor, Tensor]:
    from attn_ext.triton.tree_cross_attention_bwd import tree_cross_attention_bwd_triton

    return tree_cross_attention_bwd_triton(grad_out, grad_lse, grad_log_prob, grad_entropy, q, node_k, node_v,
                                           node_padding_mask, selected, lse, branching, height, group_size, scale)


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


def _autograd_backward(backward_op: Callable[..., Tuple[Tensor, Tensor, Tensor]]):
    def backward(ctx, grad_out: Optional[Tensor], grad_lse: Optional[Tensor], grad_selected,
                 grad_log_prob: Optional[Tensor], grad_entropy: Optional[Tensor]):
        q, node_k, node_v, node_padding_mask, selected, out, lse, log_prob = ctx.saved_tensors
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out
        grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
        grad_log_prob = torch.zeros_like(log_prob) if grad_log_prob is None else grad_log_prob
        grad_entropy = torch.zeros_like(log_prob) if grad_entropy is None else grad_entropy
        grad_q, grad_k, grad_v = backward_op(grad_out, grad_lse, grad_log_prob, grad_entropy, q, node_k, node_v,
                                             node_padding_mask, selected, lse, *ctx.tree)
        return grad_q, grad_k, grad_v, None, None, None, None, None, None

    return backward


def _register(forward_name: str, backward_name: str) -> None:
    register_op_pair(forward_name, backward_name, _fake_forward, _fake_backward, _autograd_backward, _setup_context)


_register("attn_ext::tree_cross_attention_fwd_triton", "attn_ext::tree_cross_attention_bwd_triton")
if extension_error() is None:
    _register("attn_ext::tree_cross_attention_fwd", "attn_ext::tree_cross_attention_bwd")
