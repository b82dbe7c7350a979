// Host-side interface of the CUDA masked-mean tree aggregation (docs/spec.md §3 "Aggregate") and its
// backward, the same computation as csrc/cpu/tree_aggregate.cpp. Only CUDA runtime types.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/launch_geometry.h"
#include "tree_plan.h"

namespace attn_ext {
namespace cuda {

/// The tree (ids as attn_ext/tree/build.py) and its leaf slots.
struct TreeAggregateShape {
  int64_t B = 0, tokens = 0, E = 0;
  int64_t branching = 2, height = 0, group_size = 1;
  int64_t group_offset = 0, leaf_offset = 0, nodes = 0;  ///< leaves = nodes − leaf_offset
  ScalarType dtype = ScalarType::kFloat32;
};

struct TreeAggregateFwdParams {
  TreeAggregateShape s;
  const void* leaf_values = nullptr;  ///< [B, tokens, E], innermost stride 1
  int64_t values_stride_b = 0, values_stride_n = 0;
  const int64_t* leaf_token = nullptr;         ///< [B, leaves] contiguous, −1 at padding slots
  const uint8_t* node_padding_mask = nullptr;  ///< [B, nodes] contiguous
  void* out = nullptr;                         ///< [B, nodes, E] contiguous
  float* means = nullptr;    ///< workspace [B, leaf_offset, E]: fp32 node means, read by the parents
  int32_t* bad = nullptr;    ///< device flag, zeroed by the caller: set when a valid slot names no token
};

struct TreeAggregateBwdParams {
  TreeAggregateShape s;
  const void* grad_nodes = nullptr;  ///< [B, nodes, E], innermost stride 1
  int64_t grad_stride_b = 0, grad_stride_n = 0;
  const int64_t* leaf_token = nullptr;  ///< [B, leaves] contiguous
  const int64_t* token_leaf = nullptr;  ///< [B, tokens] contiguous
  const uint8_t* node_padding_mask = nullptr;
  void* grad_values = nullptr;  ///< [B, tokens, E] contiguous
  float* shares = nullptr;      ///< workspace [B, leaf_offset, E]: what each node passes to each valid child
  int32_t* bad = nullptr;       ///< device flag, zeroed by the caller: set unless the maps are inverse
};

/// Enqueues the forward: the leaves and groups, then one launch per level bottom-up (a node's mean
/// reads its children's fp32 means, summed in child order as the CPU op, so fp32 results match it).
cudaError_t launch_tree_aggregate_fwd(const TreeAggregateFwdParams& p, cudaStream_t stream);

/// Enqueues the backward: a check of the token/leaf maps, one launch per level top-down for the
/// shares, then one per token: its leaf slot's own gradient plus its group's share (0 if padded).
cudaError_t launch_tree_aggregate_bwd(const TreeAggregateBwdParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace attn_ext
