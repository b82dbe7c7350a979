// Device code of the CUDA Tree Cross Attention backward, the CUDA twin of
// csrc/cpu/tree_cross_attention_bwd.cpp (same attn_ext/tree_descent.h helpers and formulas).
//
// One warp per query. The path is rebuilt from the group's first leaf in `selected`
// (tree_path_from_leaf). Along it, per level: the child scores of every head, lane 0 computes the
// policy and dπ/H (tree_policy / tree_policy_backward, coupling the heads) and each head's
// child-logit gradients (tree_head_weights / tree_head_logit_backward); the warp then adds them to
// dq (shared memory, lanes over D) and, atomically, to dk. Then per head the attention backward over
// S: P_j = exp(s_j − lse), dP_j = dO·v_j, Δ = Σ_j P_j dP_j, dS_j = P_j (dP_j − Δ + dlse).
// dk/dv are fp32 atomics; the CPU op is deterministic instead (per-(b, h) ownership), so the two
// agree to rounding, not bitwise.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "attn_ext/tree_descent.h"
#include "tree_warp_common.cuh"

namespace attn_ext {
namespace cuda {
namespace detail {

struct TreeBwdWarpSmem {
  int64_t* path;
  float *q, *dq, *grad_out, *scores, *pi, *dw, *dl, *w, *prob, *dprob;
  bool* child_pad;
};

__device__ __forceinline__ TreeBwdWarpSmem tree_bwd_warp_smem(unsigned char* base, const TreeWarpLayout& l) {
  TreeBwdWarpSmem s;
  s.path = reinterpret_cast<int64_t*>(base + l.path);
  s.q = reinterpret_cast<float*>(base + l.q);
  s.dq = reinterpret_cast<float*>(base + l.dq);
  s.grad_out = reinterpret_cast<float*>(base + l.grad_out);
  s.scores = reinterpret_cast<float*>(base + l.child_scores);
  s.pi = reinterpret_cast<float*>(base + l.pi);
  s.dw = reinterpret_cast<float*>(base + l.dw);
  s.dl = reinterpret_cast<float*>(base + l.dl);
  s.w = reinterpret_cast<float*>(base + l.w);
  s.prob = reinterpret_cast<float*>(base + l.prob);
  s.dprob = reinterpret_cast<float*>(base + l.dprob);
  s.child_pad = reinterpret_cast<bool*>(base + l.child_pad);
  return s;
}

/// dq_h += g·k_id and dk[id] += g·q_h (atomic), lanes over D.
template <typename scalar_t>
__device__ __forceinline__ void tree_add_key_grad(float* dq_h, float* dk_row, const float* q_h, const scalar_t* k_row,
                                                  float g, int64_t D, int lane) {
  for (int64_t d = lane; d < D; d += 32) {
    dq_h[d] = fmaf(g, to_float(k_row[d]), dq_h[d]);
    atomicAdd(dk_row + d, g * q_h[d]);
  }
}

/// Launched with plan_tree_cross_attention(..., backward = true).
/// The minimum of 2 blocks per SM in the launch bounds lets ptxas use ~96 registers: with the
/// block size alone it settled at 64–72 and spilled (CUDA 13, -Xptxas -v).
template <typename scalar_t>
__global__ void __launch_bounds__(32 * kTreeMaxWarps, 2) tree_cross_attention_bwd_kernel(const TreeBwdParams p) {
  extern __shared__ float4 smem_raw[];
  const TreeShapeParams& s = p.s;
  const int warps = static_cast<int>(blockDim.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const TreeWarpLayout layout = tree_warp_layout(s.H, s.D, s.Dv, s.branching, s.group_size, s.height, true);
  const TreeBwdWarpSmem w =
      tree_bwd_warp_smem(reinterpret_cast<unsigned char*>(smem_raw) + (threadIdx.x / 32) * layout.bytes, layout);
  const TreeQuery t = tree_query(s, warps);
  const int64_t b = s.branching, P = s.group_size, S = s.selected, H = s.H, D = s.D, Dv = s.Dv;
  const uint8_t* mask_row = p.node_padding_mask + t.b * s.mask_stride_b;
  const int64_t* sel = p.selected + t.unit * S;
  const scalar_t* k = static_cast<const scalar_t*>(p.node_k) + t.b * s.k_stride_b;
  const scalar_t* v = static_cast<const scalar_t*>(p.node_v) + t.b * s.v_stride_b;
  // An inactive warp (past the last query) still runs every barrier but adds nothing anywhere.
  const float active = t.active ? 1.0f : 0.0f;

  tree_load_query<scalar_t>(w.q, p.q, s, t, lane);
  for (int64_t idx = lane; idx < H * D; idx += 32) w.dq[idx] = 0.0f;
  if (lane == 0) tree_path_from_leaf(sel[S - P], b, s.height, P, s.group_offset, s.leaf_offset, w.path);
  __syncwarp();

  // Policy terms along the path.
  const float glp = p.grad_log_prob[t.unit] * active, gent = p.grad_entropy[t.unit] * active;
  for (int64_t level = 0; level < s.height; ++level) {
    const int64_t node = w.path[level], first = node * b + 1;
    tree_child_scores<scalar_t>(w.scores, w.child_pad, w.q, p.node_k, mask_row, s, t, node, lane);
    if (lane == 0) {
      tree_policy(w.scores, H, static_cast<int>(b), w.child_pad, w.pi);
      tree_policy_backward(w.pi, static_cast<int>(b), static_cast<int>(w.path[level + 1] - first), glp, gent, H, w.dw);
      for (int64_t h = 0; h < H; ++h) {
        tree_head_weights(w.scores + h * b, static_cast<int>(b), w.child_pad, w.w);
        tree_head_logit_backward(w.w, w.dw, static_cast<int>(b), w.dl + h * b);
      }
    }
    __syncwarp();
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t c = 0; c < b; ++c) {
        const float dl = w.dl[h * b + c];
        if (dl == 0.0f) continue;  // padding children and a zero upstream gradient: never read their keys
        tree_add_key_grad(w.dq + h * D, p.grad_node_k + ((t.b * H + h) * s.nodes + first + c) * D, w.q + h * D,
                          k + h * s.k_stride_h + (first + c) * s.k_stride_n, dl * s.scale, D, lane);
      }
    }
    __syncwarp();  // dl, scores and child_pad are rewritten by the next level
  }

  // Attention over the selected set, head by head.
  for (int64_t h = 0; h < H; ++h) {
    const int64_t row = (t.b * H + h) * s.M + t.m;
    const float lse = p.lse[row];
    const scalar_t* go = static_cast<const scalar_t*>(p.grad_out) + row * Dv;
    for (int64_t d = lane; d < Dv; d += 32) w.grad_out[d] = to_float(go[d]);
    __syncwarp();
    for (int64_t j = 0; j < S; ++j) {
      const int64_t id = sel[j];
      const float qk = tree_warp_dot(w.q + h * D, k + h * s.k_stride_h + id * s.k_stride_n, D, lane);
      const float dp = tree_warp_dot(w.grad_out, v + h * s.v_stride_h + id * s.v_stride_n, Dv, lane);
      if (lane == 0) {
        const bool skip = mask_row[id] != 0 || is_negative_infinity(lse);  // an empty row has no gradient
        w.prob[j] = skip ? 0.0f : math_exp(qk * s.scale - lse);
        w.dprob[j] = skip ? 0.0f : dp;
      }
    }
    __syncwarp();
    float delta = 0.0f;  // every lane, same order as the CPU kernel
    for (int64_t j = 0; j < S; ++j) delta += w.prob[j] * w.dprob[j];
    const float glse = p.grad_lse[row];
    for (int64_t j = 0; j < S; ++j) {
      const float prob = w.prob[j] * active;
      if (prob == 0.0f) continue;
      const int64_t id = sel[j];
      const float ds = prob * (w.dprob[j] - delta + glse) * s.scale;
      const int64_t node_row = (t.b * H + h) * s.nodes + id;
      tree_add_key_grad(w.dq + h * D, p.grad_node_k + node_row * D, w.q + h * D, k + h * s.k_stride_h + id * s.k_stride_n,
                        ds, D, lane);
      for (int64_t d = lane; d < Dv; d += 32) atomicAdd(p.grad_node_v + node_row * Dv + d, prob * w.grad_out[d]);
    }
    __syncwarp();  // grad_out, prob and dprob are rewritten for the next head
  }

  if (!t.active) return;
  for (int64_t h = 0; h < H; ++h) {
    scalar_t* dq = static_cast<scalar_t*>(p.grad_q) + ((t.b * H + h) * s.M + t.m) * D;
    for (int64_t d = lane; d < D; d += 32) dq[d] = from_float<scalar_t>(w.dq[h * D + d]);
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
