// Launch geometry of the CUDA Tree Cross Attention kernels (one warp per query), as plain C++17:
// warps per block and the per-warp shared-memory layout, which the kernels compute with the same
// functions (they are constexpr and callable from device code) so the two cannot drift apart.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/launch_geometry.h"
#include "common/smem_limits.h"

#if defined(__CUDACC__)
#define ATTN_EXT_PLAN_HD __host__ __device__
#else
#define ATTN_EXT_PLAN_HD
#endif

namespace attn_ext {
namespace cuda {

/// Per-warp shared memory: byte offsets of each array and the total (a multiple of 16 bytes).
/// Forward: q [H·D], acc [H·Dv], child scores [H·b], folded scores [H·blk], π [b], online-softmax rows
/// [2·H] (max, sum), ids [blk] (int64), child padding [b] and folded padding [blk] (bool), the choice.
/// Backward reuses the layout and adds dq [H·D], dO [Dv], dπ/H [b], child-logit gradients [H·b],
/// head weights [b], P and dP over the selected set [2·S], and the path [height + 1] (int64).
struct TreeWarpLayout {
  int64_t ids, path, q, acc, child_scores, scores, pi, rows, dq, grad_out, dw, dl, w, prob, dprob, choice, child_pad,
      fold_pad, bytes;
};

ATTN_EXT_PLAN_HD constexpr int64_t tree_align16(int64_t x) { return (x + 15) / 16 * 16; }

/// The layout for H heads, head dims D / Dv, branching b, group size P and height; `backward` adds
/// the backward's arrays (otherwise their sizes are 0).
ATTN_EXT_PLAN_HD constexpr TreeWarpLayout tree_warp_layout(int64_t H, int64_t D, int64_t Dv, int64_t b, int64_t P,
                                                           int64_t height, bool backward) {
  const int64_t blk = b > P ? b : P, S = height * (b - 1) + P, f = 4;
  TreeWarpLayout l{};
  l.ids = 0;  // int64 arrays first: 8-byte aligned from the 16-byte aligned warp base
  l.path = l.ids + 8 * blk;
  l.q = l.path + 8 * (height + 1);
  l.acc = l.q + f * H * D;
  l.child_scores = l.acc + f * H * Dv;
  l.scores = l.child_scores + f * H * b;
  l.pi = l.scores + f * H * blk;
  l.rows = l.pi + f * b;
  l.dq = l.rows + f * 2 * H;
  l.grad_out = l.dq + (backward ? f * H * D : 0);
  l.dw = l.grad_out + (backward ? f * Dv : 0);
  l.dl = l.dw + (backward ? f * b : 0);
  l.w = l.dl + (backward ? f * H * b : 0);
  l.prob = l.w + (backward ? f * b : 0);
  l.dprob = l.prob + (backward ? f * S : 0);
  l.choice = l.dprob + (backward ? f * S : 0);
  l.child_pad = l.choice + 4;
  l.fold_pad = l.child_pad + b;
  l.bytes = tree_align16(l.fold_pad + blk);
  return l;
}

/// Warps (queries) per block when the layout allows: shared memory is per warp, so wide heads get fewer
/// (as many as fit without opting in to more than 48 KiB; one warp may then opt in to the device's limit).
constexpr int kTreeMaxWarps = 4;

struct TreeLaunchPlan {
  bool supported = false;
  const char* error = nullptr;
  bool empty = false;
  LaunchDims grid;  ///< x = block of `warps` queries (b·M + m order)
  LaunchDims block;
  int warps = 0;
  std::size_t warp_bytes = 0;
  std::size_t shared_memory_bytes = 0;
  SmemShortfall smem;  ///< set when one query's state does not fit the device
};

/// Plans the forward (backward = false) or backward kernel for B·M queries on a device with
/// `smem_limit` bytes of opt-in shared memory per block.
inline TreeLaunchPlan plan_tree_cross_attention(int64_t B, int64_t M, int64_t H, int64_t D, int64_t Dv,
                                                int64_t branching, int64_t group_size, int64_t height, bool backward,
                                                std::size_t smem_limit) {
  TreeLaunchPlan plan;
  if (B < 0 || M < 0 || H < 1 || D < 1 || Dv < 1) {
    plan.error = "sizes must be B, M >= 0 and H, D, Dv >= 1";
    return plan;
  }
  if (branching < 2 || branching > 1024 || group_size < 1 || group_size > 65536 || height < 0 || height > 62) {
    plan.error = "branching must be in [2, 1024], group_size in [1, 65536], height in [0, 62]";
    return plan;
  }
  if (H > 4096 || D > 4096 || Dv > 4096) {
    plan.error = "H, D and Dv must be at most 4096";
    return plan;
  }
  plan.warp_bytes = static_cast<std::size_t>(
      tree_warp_layout(H, D, Dv, branching, group_size, height, backward).bytes);
  plan.warps = kTreeMaxWarps;
  const std::size_t without_opt_in = smem_limit < kDefaultDynamicSmemBytes ? smem_limit : kDefaultDynamicSmemBytes;
  while (plan.warps > 1 && plan.warps * plan.warp_bytes > without_opt_in) plan.warps /= 2;
  plan.shared_memory_bytes = plan.warps * plan.warp_bytes;
  if (plan.shared_memory_bytes > smem_limit) {
    // One warp holds one query's state (H·(D + Dv) floats and the tree arrays): there is no smaller tile.
    plan.error = smem_shortfall(plan.smem, backward ? "tree cross attention backward (one query per warp)"
                                                    : "tree cross attention forward (one query per warp)",
                                plan.shared_memory_bytes, smem_limit);
    return plan;
  }
  plan.block.x = static_cast<unsigned int>(32 * plan.warps);
  plan.supported = true;
  if (B == 0 || M == 0) {
    plan.empty = true;
    plan.grid.x = 0;
    return plan;
  }
  const int64_t blocks = (B * M + plan.warps - 1) / plan.warps;
  if (M > kMaxGridX / B || blocks > kMaxGridX) {
    plan.supported = false;
    plan.error = "too many queries for the CUDA grid";
    return plan;
  }
  plan.grid.x = static_cast<unsigned int>(blocks);
  return plan;
}

/// Threads per block of the aggregation kernels: one thread per feature column of a node.
constexpr int kTreeAggregateThreads = 128;

/// Grid of one aggregation launch over `items` rows (nodes of a level, tokens, or leaf slots, over
/// the batch) of `columns` features: x = item, y = block of kTreeAggregateThreads columns.
inline TreeLaunchPlan plan_tree_aggregate(int64_t items, int64_t columns) {
  TreeLaunchPlan plan;
  if (items < 0 || columns < 0) {
    plan.error = "negative size";
    return plan;
  }
  plan.block.x = kTreeAggregateThreads;
  plan.supported = true;
  if (items == 0 || columns == 0) {
    plan.empty = true;
    plan.grid.x = 0;
    return plan;
  }
  const int64_t col_blocks = (columns + kTreeAggregateThreads - 1) / kTreeAggregateThreads;
  if (items > kMaxGridX || col_blocks > kMaxGridY) {
    plan.supported = false;
    plan.error = "too many tree nodes or features for the CUDA grid";
    return plan;
  }
  plan.grid.x = static_cast<unsigned int>(items);
  plan.grid.y = static_cast<unsigned int>(col_blocks);
  return plan;
}

}  // namespace cuda
}  // namespace attn_ext
