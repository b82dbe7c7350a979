// Sizes of a Tree Cross Attention call and their validation, shared by the CPU forward and backward.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace attn_ext::cpu {

/// Sizes of one call; node ids follow attn_ext/tree/build.py (heap layout, then groups, then leaves).
struct TreeShape {
  int64_t batch, heads, queries, head_dim, value_dim, nodes;
  int64_t branching, height, group_size;
  int64_t leaf_offset;   ///< id of leaf slot 0 (number of internal and group nodes)
  int64_t group_offset;  ///< id of group 0 (first node of level `height`)
  int64_t selected;      ///< |S| = height·(b − 1) + group_size
};

/// Validates the forward's inputs (ranks, sizes against the tree, dtypes, devices, mask, uniforms)
/// with errors that name the shapes, and returns the sizes.
TreeShape check_tree_inputs(const at::Tensor& q, const at::Tensor& node_k, const at::Tensor& node_v,
                            const at::Tensor& node_padding_mask, int64_t branching, int64_t height,
                            int64_t group_size, double scale, const std::optional<at::Tensor>& uniforms);

}  // namespace attn_ext::cpu
