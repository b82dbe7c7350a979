// Device code of the CUDA masked-mean tree aggregation and its backward (csrc/cpu/tree_aggregate.cpp
// is the CPU twin): level-synchronous, one block per node (or token) and 128 feature columns, one
// thread per column, so every row access is coalesced and no atomics are needed.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "common/dtypes.cuh"
#include "tree_aggregate.cuh"

namespace attn_ext {
namespace cuda {
namespace detail {

/// Level-`level` nodes, blockIdx.x = e·width + index: the mean of the valid children (the leaves of a
/// group at level == height, copied to their slots on the way), 0 for a padding node or one without
/// valid children; written to `out` and, in fp32, to `means` for the parent level.
template <typename scalar_t>
__global__ void __launch_bounds__(kTreeAggregateThreads) tree_aggregate_level_kernel(const TreeAggregateFwdParams p,
                                                                                     int64_t level_first,
                                                                                     int64_t width, bool groups) {
  const TreeAggregateShape& s = p.s;
  const int64_t e = blockIdx.x / width, id = level_first + blockIdx.x % width;
  const int64_t col = static_cast<int64_t>(blockIdx.y) * kTreeAggregateThreads + threadIdx.x;
  if (col >= s.E) return;  // no barriers in this kernel
  const uint8_t* pad = p.node_padding_mask + e * s.nodes;
  scalar_t* out = static_cast<scalar_t*>(p.out) + e * s.nodes * s.E;
  float* means = p.means + e * s.leaf_offset * s.E;
  float sum = 0.0f;
  int64_t count = 0;
  if (groups) {
    const int64_t leaves = s.nodes - s.leaf_offset, slot0 = (id - s.group_offset) * s.group_size;
    const scalar_t* values = static_cast<const scalar_t*>(p.leaf_values) + e * p.values_stride_b;
    for (int64_t slot = slot0; slot < slot0 + s.group_size; ++slot) {
      const int64_t t = p.leaf_token[e * leaves + slot];
      scalar_t* row = out + (s.leaf_offset + slot) * s.E;
      if (pad[s.leaf_offset + slot] || t < 0 || t >= s.tokens) {
        if (!pad[s.leaf_offset + slot] && col == 0) *p.bad = 1;  // reported by the caller
        row[col] = from_float<scalar_t>(0.0f);
        continue;
      }
      const scalar_t x = values[t * p.values_stride_n + col];
      row[col] = x;
      sum += to_float(x);
      ++count;
    }
  } else {
    for (int64_t child = id * s.branching + 1; child <= id * s.branching + s.branching; ++child) {
      if (pad[child]) continue;
      sum += means[child * s.E + col];
      ++count;
    }
  }
  const float mean = (pad[id] || count == 0) ? 0.0f : sum / static_cast<float>(count);
  means[id * s.E + col] = mean;
  out[id * s.E + col] = from_float<scalar_t>(mean);
}

/// Backward, level-`level` nodes top-down: share = (own gradient + the parent's share) / number of
/// valid children, 0 for a padding node or one without valid children (nothing flows down).
template <typename scalar_t>
__global__ void __launch_bounds__(kTreeAggregateThreads) tree_aggregate_share_kernel(const TreeAggregateBwdParams p,
                                                                                     int64_t level_first,
                                                                                     int64_t width, bool groups) {
  const TreeAggregateShape& s = p.s;
  const int64_t e = blockIdx.x / width, id = level_first + blockIdx.x % width;
  const int64_t col = static_cast<int64_t>(blockIdx.y) * kTreeAggregateThreads + threadIdx.x;
  if (col >= s.E) return;
  const uint8_t* pad = p.node_padding_mask + e * s.nodes;
  const int64_t first = groups ? s.leaf_offset + (id - s.group_offset) * s.group_size : id * s.branching + 1;
  const int64_t children = groups ? s.group_size : s.branching;
  int64_t count = 0;
  for (int64_t j = 0; j < children; ++j) count += pad[first + j] ? 0 : 1;
  float* shares = p.shares + e * s.leaf_offset * s.E;
  float share = 0.0f;
  if (!pad[id] && count > 0) {
    const scalar_t* g = static_cast<const scalar_t*>(p.grad_nodes) + e * p.grad_stride_b + id * p.grad_stride_n;
    const float from_parent = id == 0 ? 0.0f : shares[((id - 1) / s.branching) * s.E + col];
    share = (to_float(g[col]) + from_parent) / static_cast<float>(count);
  }
  shares[id * s.E + col] = share;
}

/// Backward, one block per token (blockIdx.x = e·tokens + t): the gradient of its leaf slot plus its
/// group's share, 0 at a padding slot. Also checks token_leaf against leaf_token.
template <typename scalar_t>
__global__ void __launch_bounds__(kTreeAggregateThreads) tree_aggregate_token_kernel(const TreeAggregateBwdParams p) {
  const TreeAggregateShape& s = p.s;
  const int64_t e = blockIdx.x / s.tokens, t = blockIdx.x % s.tokens;
  const int64_t col = static_cast<int64_t>(blockIdx.y) * kTreeAggregateThreads + threadIdx.x;
  if (col >= s.E) return;
  const int64_t leaves = s.nodes - s.leaf_offset, slot = p.token_leaf[e * s.tokens + t];
  scalar_t* dst = static_cast<scalar_t*>(p.grad_values) + (e * s.tokens + t) * s.E;
  if (slot < 0 || slot >= leaves || p.leaf_token[e * leaves + slot] != t) {
    if (col == 0) *p.bad = 1;
    dst[col] = from_float<scalar_t>(0.0f);
    return;
  }
  if (p.node_padding_mask[e * s.nodes + s.leaf_offset + slot]) {
    dst[col] = from_float<scalar_t>(0.0f);
    return;
  }
  const scalar_t* own = static_cast<const scalar_t*>(p.grad_nodes) + e * p.grad_stride_b +
                        (s.leaf_offset + slot) * p.grad_stride_n;
  const float share = p.shares[(e * s.leaf_offset + s.group_offset + slot / s.group_size) * s.E + col];
  dst[col] = from_float<scalar_t>(to_float(own[col]) + share);
}

/// One thread per leaf slot: a slot naming a token must be that token's slot in token_leaf (the
/// other half of "inverse maps"; tree_aggregate_token_kernel checks the tokens' side).
__global__ void __launch_bounds__(kTreeAggregateThreads) tree_aggregate_slot_check_kernel(const TreeAggregateBwdParams p) {
  const TreeAggregateShape& s = p.s;
  const int64_t leaves = s.nodes - s.leaf_offset;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kTreeAggregateThreads + threadIdx.x;
  if (idx >= s.B * leaves) return;
  const int64_t e = idx / leaves, slot = idx % leaves, t = p.leaf_token[idx];
  if (t < 0) return;
  if (t >= s.tokens || p.token_leaf[e * s.tokens + t] != slot) *p.bad = 1;
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
