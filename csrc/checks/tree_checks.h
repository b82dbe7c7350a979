// Argument checks of the tree ops (Tree Cross Attention and the tree aggregation), shared by the
// CPU ops and the CUDA bindings so that both fail with the same messages, and the node-id layout of
// attn_ext/tree/build.py they validate against: heap-ordered internal nodes, the groups at level
// `height`, then group_size leaf slots per group.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace attn_ext {

/// Node ids of a tree of branching b, height k and group size P.
struct TreeIds {
  int64_t group_offset;  ///< id of group 0 (first node of level k): (b^k − 1)/(b − 1)
  int64_t leaf_offset;   ///< id of leaf slot 0 (number of internal and group nodes): (b^(k+1) − 1)/(b − 1)
  int64_t leaves;        ///< P·b^k leaf slots
  int64_t nodes;         ///< leaf_offset + leaves
  int64_t selected;      ///< |S| = k·(b − 1) + P: the nodes one query attends to
};

/// Whether the ids of the tree fit in int64 (the caller checked b ≥ 2, k ≥ 0, P ≥ 1).
bool tree_ids_fit(int64_t branching, int64_t height, int64_t group_size);
/// The ids of a tree for which tree_ids_fit() holds.
TreeIds tree_ids(int64_t branching, int64_t height, int64_t group_size);

/// Sizes of one Tree Cross Attention call.
struct TreeShape {
  int64_t batch, heads, queries, head_dim, value_dim, nodes;
  int64_t branching, height, group_size;
  int64_t leaf_offset;   ///< id of leaf slot 0 (number of internal and group nodes)
  int64_t group_offset;  ///< id of group 0 (first node of level `height`)
  int64_t selected;      ///< |S| = height·(b − 1) + group_size
};

/// Validates tree_cross_attention_fwd's inputs (ranks, sizes against the tree, dtypes, devices, mask,
/// uniforms) with errors that name the shapes, and returns the sizes.
TreeShape check_tree_inputs(const at::Tensor& q, const at::Tensor& node_k, const at::Tensor& node_v,
                            const at::Tensor& node_padding_mask, int64_t branching, int64_t height,
                            int64_t group_size, double scale, const std::optional<at::Tensor>& uniforms);

/// Validates tree_cross_attention_bwd's gradients and the forward's saved `selected` and `lse`
/// against the sizes of its other inputs (checked by check_tree_inputs). Reads `selected`: its ids
/// index the node arrays, and the path is rebuilt from each query's first leaf (one synchronisation
/// on CUDA).
void check_tree_bwd_inputs(const TreeShape& s, const at::Tensor& grad_out, const at::Tensor& grad_lse,
                           const at::Tensor& grad_log_prob, const at::Tensor& grad_entropy,
                           const at::Tensor& selected, const at::Tensor& lse);

/// Sizes of one tree aggregation call: the tree's ids and the payload [B, tokens or nodes, dim].
struct TreeAggregateSizes {
  int64_t batch, tokens, dim, branching, height, group_size;
  TreeIds ids;
};

/// Validates tree_aggregate_fwd's inputs: leaf_values [B, N, E], leaf_token [B, leaves] int64 and
/// node_padding_mask [B, nodes] bool on one device. The dtype of leaf_values is each device's to check.
TreeAggregateSizes check_tree_aggregate_fwd_inputs(const at::Tensor& leaf_values, const at::Tensor& leaf_token,
                                                   const at::Tensor& node_padding_mask, int64_t branching,
                                                   int64_t height, int64_t group_size);

/// Validates tree_aggregate_bwd's inputs: grad_nodes [B, nodes, E], and token_leaf [B, num_tokens]
/// besides the forward's tree tensors.
TreeAggregateSizes check_tree_aggregate_bwd_inputs(const at::Tensor& grad_nodes, const at::Tensor& leaf_token,
                                                   const at::Tensor& token_leaf, const at::Tensor& node_padding_mask,
                                                   int64_t branching, int64_t height, int64_t group_size,
                                                   int64_t num_tokens);

}  // namespace attn_ext
