// Tiles of the FlashAttention-2-style backward (attention_bwd_mma_kernel.cuh), as plain C++17 shared by
// the launcher, the kernel's static_asserts and the host tests.
//
// Like the WMMA backward it replaces from sm_80 on, two kernels after the Δ pre-pass: dK/dV (a block owns
// 64 keys of one key/value head and streams the query tiles of the head's kv_group query heads) and dQ
// (a block owns 64 queries and streams the key tiles); every gradient element belongs to one warp of one
// block, so the results are deterministic (no atomics). Each warp owns 16 rows and keeps their
// accumulators (dK and dV, or dQ) in registers: 2·dim/2 registers per lane in the dK/dV kernel, so the
// head-dim buckets 32, 64 and 128 take it and 256 stays on the WMMA kernel. The eligibility of a call
// is the forward's (mma_fwd_ineligible: rows on 16-byte boundaries, D and Dv multiples of 8) over the
// strides of q, k, v and grad_out.
#pragma once

#include <cstddef>

namespace attn_ext {
namespace cuda {

constexpr int kMmaBwdWarps = 4;
constexpr int kMmaBwdOwnRows = 16 * kMmaBwdWarps;  ///< rows a block owns (keys or queries)
constexpr int kMmaBwdMaxDim = 128;

/// Rows of the streamed side per tile: the scores and their gradients of one streamed tile live in
/// registers beside the accumulators (16 × streamed fp32 values each per warp), so wide heads stream less.
constexpr int mma_bwd_streamed_rows(int dim) { return dim <= 64 ? 64 : 32; }

constexpr int mma_bwd_smem_stride(int dim) { return dim + 8; }  // elements; see mma_fwd_smem_stride

/// Dynamic shared memory of either kernel: the owned pair of tiles (K, V or Q, dO), the streamed pair,
/// and fp32 per-row data: lse, Δ and dlse of the query rows (64 of the streamed or owned side) and the
/// key biases (0 or −inf) of 64 keys.
constexpr std::size_t mma_bwd_smem_bytes(int dim) {
  return 2 * 2 * static_cast<std::size_t>(kMmaBwdOwnRows + mma_bwd_streamed_rows(dim)) * mma_bwd_smem_stride(dim) +
         4 * 4 * static_cast<std::size_t>(kMmaBwdOwnRows);
}

}  // namespace cuda
}  // namespace attn_ext
