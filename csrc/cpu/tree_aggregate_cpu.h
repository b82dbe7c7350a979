// CPU implementation of attn_ext::tree_aggregate_{fwd,bwd} (schemas in csrc/ops.cpp).
#pragma once

#include <ATen/ATen.h>

namespace attn_ext::cpu {

/// Node values [B, num_nodes, E] of a Tree Cross Attention tree (SPEC §3 "Aggregate", masked mean) from
/// the tokens' values leaf_values [B, N, E]: leaf slot s holds token leaf_token[:, s] (0 for padding
/// leaves), every other node the mean of its valid children (0 for padding nodes). Node ids as in
/// attn_ext/tree/build.py; output in the input dtype, sums and means in fp32 for fp16/bf16.
at::Tensor tree_aggregate_fwd_cpu(const at::Tensor& leaf_values, const at::Tensor& leaf_token,
                                  const at::Tensor& node_padding_mask, int64_t branching, int64_t height,
                                  int64_t group_size);

/// Gradient of the tokens' values [B, num_tokens, E] from that of the node values [B, num_nodes, E];
/// token_leaf [B, num_tokens] is the inverse permutation of leaf_token (checked). Masked tokens get 0.
at::Tensor tree_aggregate_bwd_cpu(const at::Tensor& grad_nodes, const at::Tensor& leaf_token,
                                  const at::Tensor& token_leaf, const at::Tensor& node_padding_mask,
                                  int64_t branching, int64_t height, int64_t group_size, int64_t num_tokens);

}  // namespace attn_ext::cpu
