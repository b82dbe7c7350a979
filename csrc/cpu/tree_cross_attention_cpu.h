// CPU implementation of attn_ext::tree_cross_attention_fwd (schema in csrc/ops.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace attn_ext::cpu {

/// Fused Tree Cross Attention forward (SPEC §3): per query, descend the tree (greedy, or sampled with
/// `uniforms` [B, M, height]) and attend over the selected set with an online softmax.
/// Returns (out [B,H,M,Dv] in q's dtype, lse [B,H,M], selected [B,M,S] int64, log_prob [B,M],
/// entropy [B,M]); lse, log_prob and entropy are fp32 (fp64 for fp64 inputs).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> tree_cross_attention_fwd_cpu(
    const at::Tensor& q, const at::Tensor& node_k, const at::Tensor& node_v, const at::Tensor& node_padding_mask,
    int64_t branching, int64_t height, int64_t group_size, double scale, const std::optional<at::Tensor>& uniforms);

/// Its backward: (grad_q, grad_node_k, grad_node_v) from the gradients of (out, lse, log_prob,
/// entropy), given the forward's `selected` and `lse`. Deterministic (no atomics).
std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_cross_attention_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& grad_log_prob,
    const at::Tensor& grad_entropy, const at::Tensor& q, const at::Tensor& node_k, const at::Tensor& node_v,
    const at::Tensor& node_padding_mask, const at::Tensor& selected, const at::Tensor& lse, int64_t branching,
    int64_t height, int64_t group_size, double scale);

}  // namespace attn_ext::cpu
