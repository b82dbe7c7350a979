// Device code of the CUDA Tree Cross Attention forward (docs/spec.md §3 "Retrieve" + "Attend"), the CUDA
// twin of csrc/cpu/tree_cross_attention.cpp: same descent step (attn_ext/tree_descent.h), same
// online softmax (attn_ext/online_softmax.h), same order of folding keys, same `selected` layout.
//
// One warp per query (b, m), all heads in the warp because the policy averages them. Per level: the
// child scores of every head (warp dot products), then lane 0 takes the descent step and compacts
// the b − 1 rejected children into the fold buffers, then the warp folds them into each head's
// online-softmax row, lanes owning value columns. At the bottom the P leaves of the chosen group
// are folded the same way. Scalar, per-query state (rows, choice) lives in shared memory written by
// lane 0 between warp barriers, so the warp agrees on it without shuffles.
//
// Non-finite inputs follow the CPU kernel: a NaN descent step (log π NaN) makes the whole query's
// outputs NaN; a head whose running sum ends NaN (a NaN or +inf score) or 0 after reading a valid
// node (all scores −inf) gets NaN out and lse; NaN values reach `out` through the accumulator.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "attn_ext/online_softmax.h"
#include "attn_ext/tree_descent.h"
#include "tree_warp_common.cuh"

namespace attn_ext {
namespace cuda {
namespace detail {

/// Per-warp view of the shared-memory layout of tree_warp_layout().
struct TreeWarpSmem {
  int64_t* ids;
  float *q, *acc, *child_scores, *scores, *pi;
  OnlineSoftmaxRow<float>* rows;
  int* choice;
  bool *child_pad, *fold_pad;
};

__device__ __forceinline__ TreeWarpSmem tree_warp_smem(unsigned char* base, const TreeWarpLayout& l) {
  TreeWarpSmem w;
  w.ids = reinterpret_cast<int64_t*>(base + l.ids);
  w.q = reinterpret_cast<float*>(base + l.q);
  w.acc = reinterpret_cast<float*>(base + l.acc);
  w.child_scores = reinterpret_cast<float*>(base + l.child_scores);
  w.scores = reinterpret_cast<float*>(base + l.scores);
  w.pi = reinterpret_cast<float*>(base + l.pi);
  w.rows = reinterpret_cast<OnlineSoftmaxRow<float>*>(base + l.rows);
  w.choice = reinterpret_cast<int*>(base + l.choice);
  w.child_pad = reinterpret_cast<bool*>(base + l.child_pad);
  w.fold_pad = reinterpret_cast<bool*>(base + l.fold_pad);
  return w;
}

/// Folds the `count` keys of the fold buffers (ids, scores [h·blk + j], fold_pad) into every head's
/// row and accumulator, in key order as the CPU kernel. Barriers are unconditional (see
/// tree_warp_common.cuh); the row is written back by lane 0 after every lane has read it. Only a
/// block without valid keys is skipped, so −inf and NaN scores and NaN values reach the row (see the
/// CPU kernel). Returns whether the block held a valid key (the same on every lane).
template <typename scalar_t>
__device__ __forceinline__ bool tree_fold(const TreeWarpSmem& w, const void* node_v, const TreeShapeParams& s,
                                          const TreeQuery& t, int64_t blk, int64_t count, int lane) {
  const scalar_t* v = static_cast<const scalar_t*>(node_v) + t.b * s.v_stride_b;
  bool any_valid = false;
  for (int64_t j = 0; j < count; ++j) any_valid = any_valid || !w.fold_pad[j];
  for (int64_t h = 0; h < s.H; ++h) {
    const float* sc = w.scores + h * blk;
    float block_max = negative_infinity<float>();
    for (int64_t j = 0; j < count; ++j) {
      if (!w.fold_pad[j] && sc[j] > block_max) block_max = sc[j];
    }
    OnlineSoftmaxRow<float> row = w.rows[h];
    if (any_valid) {
      const float factor = online_softmax_advance(row, block_max);
      float* a = w.acc + h * s.Dv;
      if (factor != 1.0f) {
        for (int64_t d = lane; d < s.Dv; d += 32) a[d] *= factor;
      }
      const float shift = online_softmax_shift(row);
      for (int64_t j = 0; j < count; ++j) {
        if (w.fold_pad[j]) continue;
        const float p = math_exp(sc[j] - shift);
        row.sum += p;
        const scalar_t* vv = v + h * s.v_stride_h + w.ids[j] * s.v_stride_n;
        for (int64_t d = lane; d < s.Dv; d += 32) a[d] = fmaf(p, to_float(vv[d]), a[d]);
      }
    }
    __syncwarp();  // every lane has read rows[h]
    if (lane == 0) w.rows[h] = row;
  }
  __syncwarp();
  return any_valid;
}

/// Launched with plan_tree_cross_attention(..., backward = false): `warps` queries per block.
/// The minimum of 2 blocks per SM in the launch bounds lets ptxas use ~96 registers: with the
/// block size alone it settled at 64–72 and spilled (CUDA 13, -Xptxas -v).
template <typename scalar_t>
__global__ void __launch_bounds__(32 * kTreeMaxWarps, 2) tree_cross_attention_fwd_kernel(const TreeFwdParams p) {
  extern __shared__ float4 smem_raw[];
  const TreeShapeParams& s = p.s;
  const int warps = static_cast<int>(blockDim.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const TreeWarpLayout layout = tree_warp_layout(s.H, s.D, s.Dv, s.branching, s.group_size, s.height, false);
  const TreeWarpSmem w = tree_warp_smem(reinterpret_cast<unsigned char*>(smem_raw) + (threadIdx.x / 32) * layout.bytes,
                                        layout);
  const TreeQuery t = tree_query(s, warps);
  const int64_t b = s.branching, P = s.group_size, blk = b > P ? b : P;
  const uint8_t* mask_row = p.node_padding_mask + t.b * s.mask_stride_b;
  int64_t* sel = p.selected + t.unit * s.selected;

  tree_load_query<scalar_t>(w.q, p.q, s, t, lane);
  for (int64_t idx = lane; idx < s.H * s.Dv; idx += 32) w.acc[idx] = 0.0f;
  for (int64_t h = lane; h < s.H; h += 32) w.rows[h] = online_softmax_empty<float>();
  __syncwarp();

  int64_t node = 0, written = 0;
  float log_prob = 0.0f, entropy = 0.0f;  // lane 0's
  bool seen_valid = false;                // every lane's
  for (int64_t level = 0; level < s.height; ++level) {
    tree_child_scores<scalar_t>(w.child_scores, w.child_pad, w.q, p.node_k, mask_row, s, t, node, lane);
    const int64_t first = node * b + 1;
    if (lane == 0) {
      const bool sample = p.uniforms != nullptr;
      const float u = sample ? p.uniforms[t.unit * s.height + level] : 0.0f;
      const TreeStep<float> step =
          tree_descent_step(w.child_scores, s.H, static_cast<int>(b), w.child_pad, sample, u, w.pi);
      log_prob += step.log_prob;
      entropy += step.entropy;
      *w.choice = step.choice;
      int64_t j = 0;  // the rejected children, compacted to the front of the fold buffers
      for (int64_t c = 0; c < b; ++c) {
        if (c == step.choice) continue;
        w.ids[j] = first + c;
        w.fold_pad[j] = w.child_pad[c];
        for (int64_t h = 0; h < s.H; ++h) w.scores[h * blk + j] = w.child_scores[h * b + c];
        if (t.active) sel[written + j] = first + c;
        ++j;
      }
    }
    __syncwarp();
    seen_valid = tree_fold<scalar_t>(w, p.node_v, s, t, blk, b - 1, lane) || seen_valid;
    written += b - 1;
    node = first + *w.choice;
  }

  // The chosen group's P leaves.
  const int64_t leaf0 = s.leaf_offset + (node - s.group_offset) * P;
  for (int64_t j = lane; j < P; j += 32) {
    w.ids[j] = leaf0 + j;
    w.fold_pad[j] = mask_row[leaf0 + j] != 0;
    if (t.active) sel[written + j] = leaf0 + j;
  }
  __syncwarp();
  const scalar_t* k = static_cast<const scalar_t*>(p.node_k) + t.b * s.k_stride_b;
  for (int64_t h = 0; h < s.H; ++h) {
    for (int64_t j = 0; j < P; ++j) {
      const float dot = tree_warp_dot(w.q + h * s.D, k + h * s.k_stride_h + (leaf0 + j) * s.k_stride_n, s.D, lane);
      if (lane == 0) w.scores[h * blk + j] = w.fold_pad[j] ? negative_infinity<float>() : dot * s.scale;
    }
  }
  __syncwarp();
  seen_valid = tree_fold<scalar_t>(w, p.node_v, s, t, blk, P, lane) || seen_valid;
  const float lane0_log_prob = __shfl_sync(kFullWarpMask, log_prob, 0);
  const bool descent_nan = lane0_log_prob != lane0_log_prob;  // a NaN step (tree_descent_step)

  if (!t.active) return;  // after the last barrier
  for (int64_t h = 0; h < s.H; ++h) {
    const int64_t row = (t.b * s.H + h) * s.M + t.m;
    scalar_t* out = static_cast<scalar_t*>(p.out) + row * s.Dv;
    if (descent_nan || (seen_valid && !(w.rows[h].sum > 0.0f))) {
      for (int64_t d = lane; d < s.Dv; d += 32) out[d] = from_float<scalar_t>(tree_nan<float>());
      if (lane == 0) p.lse[row] = tree_nan<float>();
      continue;
    }
    const OnlineSoftmaxResult<float> done = online_softmax_finish(w.rows[h]);
    for (int64_t d = lane; d < s.Dv; d += 32) out[d] = from_float<scalar_t>(w.acc[h * s.Dv + d] * done.inv_sum);
    if (lane == 0) p.lse[row] = done.lse;
  }
  if (lane == 0) {
    p.log_prob[t.unit] = log_prob;
    p.entropy[t.unit] = entropy;
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
