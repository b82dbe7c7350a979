// Host-side interface of the CUDA Tree Cross Attention forward and backward (docs/spec.md §3), the same
// computation as csrc/cpu/tree_cross_attention{,_bwd}.cpp. Only CUDA runtime types, no ATen/c10.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/launch_geometry.h"
#include "common/qkv_layout.h"
#include "tree_plan.h"

namespace attn_ext {
namespace cuda {

/// The tree (node ids as attn_ext/tree/build.py: heap-ordered internal nodes, the groups at level
/// `height`, then the leaves) and the layout of q/node_k/node_v (innermost stride 1).
struct TreeShapeParams : QkvLayout {
  int64_t B = 0, H = 0, M = 0, D = 0, Dv = 0;
  int64_t nodes = 0, branching = 2, height = 0, group_size = 1;
  int64_t group_offset = 0, leaf_offset = 0;  ///< ids of group 0 and of leaf slot 0
  int64_t selected = 0;                        ///< S = height·(b − 1) + group_size
};

struct TreeFwdParams {
  TreeShapeParams s;
  const void* q = nullptr;                    ///< [B,H,M,D]
  const void* node_k = nullptr;               ///< [B,H,nodes,D]
  const void* node_v = nullptr;               ///< [B,H,nodes,Dv]
  const uint8_t* node_padding_mask = nullptr; ///< [B,nodes] bytes, nonzero = padding
  const float* uniforms = nullptr;            ///< [B,M,height] contiguous in [0,1); nullptr = greedy
  void* out = nullptr;                        ///< [B,H,M,Dv] contiguous, `dtype`
  float* lse = nullptr;                       ///< [B,H,M]
  int64_t* selected = nullptr;                ///< [B,M,S]: rejected children per level, then the group's leaves
  float* log_prob = nullptr;                  ///< [B,M]: Σ_t log π(a_t)
  float* entropy = nullptr;                   ///< [B,M]: Σ_t H(π_t)
};

struct TreeBwdParams {
  TreeShapeParams s;
  const void* grad_out = nullptr;       ///< [B,H,M,Dv] contiguous, `dtype`
  const float* grad_lse = nullptr;      ///< [B,H,M]
  const float* grad_log_prob = nullptr; ///< [B,M]
  const float* grad_entropy = nullptr;  ///< [B,M]
  const void* q = nullptr;
  const void* node_k = nullptr;
  const void* node_v = nullptr;
  const uint8_t* node_padding_mask = nullptr;
  const int64_t* selected = nullptr;    ///< [B,M,S] from the forward
  const float* lse = nullptr;           ///< [B,H,M] from the forward
  void* grad_q = nullptr;               ///< [B,H,M,D] contiguous, `dtype`
  float* grad_node_k = nullptr;         ///< [B,H,nodes,D] fp32, zeroed by the caller; accumulated atomically
  float* grad_node_v = nullptr;         ///< [B,H,nodes,Dv] fp32, zeroed by the caller; accumulated atomically
};

/// Enqueues the fused descent + attention: one warp per query, all heads (the policy averages
/// them). cudaErrorInvalidValue for a shape plan_tree_cross_attention() rejects on the current device
/// or null pointers.
cudaError_t launch_tree_cross_attention_fwd(const TreeFwdParams& p, cudaStream_t stream);

/// Enqueues the backward: one warp per query rebuilds its path from `selected`, then per head the
/// policy gradient along the path and the attention gradient over S. dq rows are owned; dk/dv are
/// fp32 atomics (so the summation order, unlike the CPU op's, varies run to run).
cudaError_t launch_tree_cross_attention_bwd(const TreeBwdParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace attn_ext
