// Pieces shared by the CUDA Tree Cross Attention forward and backward kernels (one warp per query).
//
// Every warp executes the same sequence of warp barriers and shuffles whatever its data (padding is
// applied by selecting after the dot product, never by skipping it), because blocks hold several
// queries and the host emulator (csrc/tests/cuda_emulation/) requires it; on a GPU it also keeps
// the warps of a block in step.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "attn_ext/macros.h"
#include "common/dtypes.cuh"
#include "common/warp.cuh"
#include "tree_cross_attention.cuh"

namespace attn_ext {
namespace cuda {
namespace detail {

/// Σ_d q[d]·k[d] over D, lanes strided over d and reduced by a butterfly, so every lane holds the
/// same (bitwise) value.
template <typename scalar_t>
__device__ __forceinline__ float tree_warp_dot(const float* q, const scalar_t* k, int64_t D, int lane) {
  float partial = 0.0f;
  for (int64_t d = lane; d < D; d += 32) partial = fmaf(q[d], to_float(k[d]), partial);
  return warp_sum(partial);
}

/// The query this warp works on: (b, m) of unit = blockIdx.x·warps + warp. Warps past the last
/// query repeat the last one (same barriers) and must not write: `active` is false for them.
struct TreeQuery {
  int64_t unit, b, m;
  bool active;
};

__device__ __forceinline__ TreeQuery tree_query(const TreeShapeParams& s, int warps) {
  const int64_t total = s.B * s.M;
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * warps + threadIdx.x / 32;
  TreeQuery t;
  t.active = unit < total;
  t.unit = t.active ? unit : total - 1;
  t.b = t.unit / s.M;
  t.m = t.unit % s.M;
  return t;
}

/// Loads the query's H rows as fp32 into q_smem [H·D] (lanes over elements).
template <typename scalar_t>
__device__ __forceinline__ void tree_load_query(float* q_smem, const void* q, const TreeShapeParams& s,
                                                const TreeQuery& t, int lane) {
  const scalar_t* base = static_cast<const scalar_t*>(q) + t.b * s.q_stride_b + t.m * s.q_stride_m;
  for (int64_t idx = lane; idx < s.H * s.D; idx += 32) {
    const int64_t h = idx / s.D, d = idx % s.D;
    q_smem[idx] = to_float(base[h * s.q_stride_h + d]);
  }
}

/// Scaled scores of the b children of `node` (first child id node·b + 1) for every head into
/// scores [H·b], −inf for padding children; child_pad [b] is filled first.
template <typename scalar_t>
__device__ __forceinline__ void tree_child_scores(float* scores, bool* child_pad, const float* q_smem,
                                                  const void* node_k, const uint8_t* mask_row,
                                                  const TreeShapeParams& s, const TreeQuery& t, int64_t node,
                                                  int lane) {
  const int64_t b = s.branching, first = node * b + 1;
  for (int64_t c = lane; c < b; c += 32) child_pad[c] = mask_row[first + c] != 0;
  __syncwarp();
  const scalar_t* k = static_cast<const scalar_t*>(node_k) + t.b * s.k_stride_b;
  for (int64_t h = 0; h < s.H; ++h) {
    for (int64_t c = 0; c < b; ++c) {
      const float dot = tree_warp_dot(q_smem + h * s.D, k + h * s.k_stride_h + (first + c) * s.k_stride_n, s.D, lane);
      if (lane == 0) scores[h * b + c] = child_pad[c] ? negative_infinity<float>() : dot * s.scale;
    }
  }
  __syncwarp();
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
