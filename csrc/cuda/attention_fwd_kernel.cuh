// Device code of the chunked cross-attention forward kernel (CUDA cores, fp32 accumulation).
//
// Work decomposition (one block = one tile of query rows of one (batch, head)):
//  * the block's Q tile is converted to fp32, pre-scaled, and kept in shared memory for the whole pass;
//  * keys and values stream through shared memory in tiles of 32 (fp32, converted once on load);
//  * each warp owns kRowsPerWarp query rows. In the score phase lane j computes the scores of key j
//    against all the warp's rows (Q read as broadcasts, K rows conflict-free thanks to the padded
//    stride); the row max is a warp reduction and feeds online_softmax_advance; in the P·V phase each
//    lane owns Dv/32 output columns and receives the probabilities by shuffle.
// The running statistics follow attn_ext/online_softmax.h so that the CPU and CUDA kernels share the
// empty-row, −inf and NaN conventions (warp_max drops NaN; the sums and accumulators keep it). One
// deviation in bookkeeping, not in math: each lane keeps its own partial `sum` (rescaled by the same
// warp-uniform factor), and the lanes are reduced once at the end instead of once per tile.
//
// Included by attention_fwd.cu (nvcc) and by csrc/tests/cuda_fwd_emulation_test.cpp, which
// runs this source on the host under g++ with shims for the CUDA builtins; keep to the builtins that
// csrc/tests/cuda_emulation/cuda_emulator.h provides, or extend it.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "attn_ext/online_softmax.h"
#include "common/dtypes.cuh"
#include "common/pair_mask.cuh"
#include "common/tile.cuh"
#include "common/warp.cuh"
#include "attention_fwd.cuh"
#include "attention_fwd_plan.h"

namespace attn_ext {
namespace cuda {
namespace detail {

/// Shared-memory layout of one block, in floats. Mirrors cross_attention_fwd_smem_bytes(), which the
/// launcher static_asserts against, so the host plan and the device offsets cannot drift apart.
template <int kBlockM, int kBlockN, int kHeadDim, int kHeadDimV>
struct FwdSmemLayout {
  static constexpr int kQStride = kHeadDim;
  static constexpr int kKStride = kHeadDim + 4;  // see cross_attention_fwd_k_tile_stride()
  static constexpr int kVStride = kHeadDimV;
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQOffset + kBlockM * kQStride;
  static constexpr int kVOffset = kKOffset + kBlockN * kKStride;
  static constexpr int kFloats = kVOffset + kBlockN * kVStride;
};

/// What a forward block works on: its first query row, batch entry (or packed sequence) and query head; its
/// sequence's queries, keys and band shift (common/packed_sequences.h: a dense batch entry's are M, N and 0);
/// and the head's q/k/v/mask base pointers (k and v of its key/value head under GQA) at the sequence's first row.
/// Where its out and lse rows start is fwd_output_row's (asked in the epilogue: not held through the key loop).
template <typename scalar_t>
struct FwdBlock {
  int64_t m0, b, h;
  int64_t M, N, shift;
  const scalar_t* q;
  const scalar_t* k;
  const scalar_t* v;
  const uint8_t* mask;
};

/// Query tile fastest in blockIdx.x: neighbouring blocks read the same head's K/V, which stays in L2.
/// 32-bit division suffices (the plan keeps gridDim.x < 2^31) and avoids the 64-bit division
/// subroutine, whose call forces spills. A packed call's grid counts the longest sequence's row tiles:
/// the caller returns when m0 >= M.
template <typename scalar_t>
__device__ __forceinline__ FwdBlock<scalar_t> fwd_block(const CrossAttentionFwdParams& p, int block_m) {
  const unsigned int num_m_tiles = static_cast<unsigned int>((p.M + block_m - 1) / block_m);
  const unsigned int heads = static_cast<unsigned int>(p.H);
  const unsigned int bh = blockIdx.x / num_m_tiles;
  const int64_t b = bh / heads, h = bh % heads;
  const int64_t kv_head = static_cast<unsigned int>(h) / static_cast<unsigned int>(p.kv_group);
  const SequenceView seq = sequence_view(p, b, p.M, p.N);
  FwdBlock<scalar_t> blk;
  blk.b = b, blk.h = h;
  blk.M = seq.M, blk.N = seq.N, blk.shift = seq.shift;
  blk.m0 = static_cast<int64_t>(blockIdx.x % num_m_tiles) * block_m;
  blk.q = static_cast<const scalar_t*>(p.q) + seq.b * p.q_stride_b + h * p.q_stride_h + seq.q0 * p.q_stride_m;
  blk.k = static_cast<const scalar_t*>(p.k) + seq.b * p.k_stride_b + kv_head * p.k_stride_h + seq.k0 * p.k_stride_n;
  blk.v = static_cast<const scalar_t*>(p.v) + seq.b * p.v_stride_b + kv_head * p.v_stride_h + seq.k0 * p.v_stride_n;
  blk.mask = p.key_padding_mask == nullptr ? nullptr : p.key_padding_mask + seq.b * p.mask_stride_b + seq.k0;
  return blk;
}

/// The block's row 0 among out [·, Dv] rows and lse values (its sequence's offsets read again: cheaper than holding
/// them in registers through the key loop).
template <typename scalar_t>
__device__ __forceinline__ int64_t fwd_output_row(const CrossAttentionFwdParams& p, const FwdBlock<scalar_t>& blk) {
  return sequence_view(p, blk.b, p.M, p.N).query_row(p.H, blk.h);
}

/// The P·V phase of one key tile: lane owns columns lane, lane + 32, ...; V rows are read
/// conflict-free; the probabilities come by shuffle from the lane that scored the key. kExact: the
/// tile's V holds a non-finite value and masked pairs (probability −0.0) must not touch it.
template <bool kExact, int kRowsPerWarp, int kColsPerLane, int kBlockN, int kVStride>
__device__ __forceinline__ void fwd_pv_phase(float (&acc)[kRowsPerWarp][kColsPerLane], const float (&s)[kRowsPerWarp],
                                             const float* __restrict__ v_tile, int lane) {
#pragma unroll 2
  for (int j = 0; j < kBlockN; ++j) {
    float vv[kColsPerLane];
#pragma unroll
    for (int t = 0; t < kColsPerLane; ++t) vv[t] = v_tile[j * kVStride + t * 32 + lane];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const float pj = __shfl_sync(kFullWarpMask, s[r], j);
#pragma unroll
      for (int t = 0; t < kColsPerLane; ++t) acc[r][t] = kExact ? masked_fma(pj, vv[t], acc[r][t]) : fmaf(pj, vv[t], acc[r][t]);
    }
  }
}

/// The forward kernel for one (dtype, D instantiation, Dv instantiation). Launched with
/// kWarps·32 threads and FwdSmemLayout<...>::kFloats floats of dynamic shared memory over the 1-D
/// grid described in attention_fwd_plan.h.
///
/// The explicit minimum of 2 blocks per SM matters: with `__launch_bounds__(threads)` alone, ptxas
/// (CUDA 13) squeezed some instantiations to ~72–80 registers and spilled; with a minimum of 2 it
/// may use up to 255 and settles at ~110–145 with no spills (checked with -Xptxas -v).
///
/// kPairMasks (attention_fwd with causal or attn_mask): each pair's mask joins the key padding in
/// the score phase (common/pair_mask.cuh: selected −inf score, −0.0 probability), a causal block
/// stops at its last visible key tile, and a V tile holding a non-finite value takes the exact P·V
/// loop. Without it, this is the cross_attention_fwd kernel as before.
template <typename scalar_t, int kHeadDim, int kHeadDimV, int kRowsPerWarp, int kWarps, bool kPairMasks = false>
__global__ void __launch_bounds__(kWarps * 32, 2)
    cross_attention_fwd_kernel(const CrossAttentionFwdParams p) {
  constexpr int kThreads = kWarps * 32;
  constexpr int kBlockN = 32;  // one key per lane in the score phase
  constexpr int kBlockM = kWarps * kRowsPerWarp;
  constexpr int kColsPerLane = kHeadDimV / 32;
  using Layout = FwdSmemLayout<kBlockM, kBlockN, kHeadDim, kHeadDimV>;
  static_assert(kHeadDim % 32 == 0 && kHeadDimV % 32 == 0, "head dims are instantiated in multiples of 32");

  extern __shared__ float4 smem_raw[];  // float4 so the float4 reads below are 16-byte aligned
  float* q_tile = reinterpret_cast<float*>(smem_raw) + Layout::kQOffset;
  float* k_tile = reinterpret_cast<float*>(smem_raw) + Layout::kKOffset;
  float* v_tile = reinterpret_cast<float*>(smem_raw) + Layout::kVOffset;

  const FwdBlock<scalar_t> blk = fwd_block<scalar_t>(p, kBlockM);
  const int64_t m0 = blk.m0, M = blk.M, N = blk.N;
  if (m0 >= M) return;  // a packed sequence shorter than the longest (block-uniform: before any barrier)
  const scalar_t* __restrict__ q = blk.q;
  const scalar_t* __restrict__ k = blk.k;
  const scalar_t* __restrict__ v = blk.v;
  const uint8_t* __restrict__ mask = blk.mask;
  const int d = static_cast<int>(p.D);
  const int dv = static_cast<int>(p.Dv);

  // Pre-scaling Q once makes the score loop pure FMAs.
  const int64_t m_rows = M - m0;
  load_tile<kThreads, kBlockM, kHeadDim, Layout::kQStride>(
      q_tile, q + m0 * p.q_stride_m, p.q_stride_m, static_cast<int>(m_rows < kBlockM ? m_rows : kBlockM), d,
      p.scale);

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const float* __restrict__ q_rows = q_tile + warp * kRowsPerWarp * Layout::kQStride;
  const float* __restrict__ k_row = k_tile + lane * Layout::kKStride;
  // Zero-padded Q and K columns add 0, so the dot product may stop at the next multiple of 4 above D.
  const int d_loop = (d + 3) & ~3;

  // Warp-uniform except `sum`, which is each lane's partial over its keys (see the file comment).
  OnlineSoftmaxRow<float> row[kRowsPerWarp];
  float acc[kRowsPerWarp][kColsPerLane];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    row[r] = online_softmax_empty<float>();
#pragma unroll
    for (int t = 0; t < kColsPerLane; ++t) acc[r][t] = 0.0f;
  }

  const PairMaskHead<scalar_t> pair_mask = pair_mask_head<scalar_t>(p, blk.b, blk.h, blk.shift);
  // The key tiles the causal rule and the band leave to the block's rows (all without pair masks).
  const IndexRange keys = kPairMasks ? band_keys(p, m0, m0 + kBlockM, N, blk.shift) : IndexRange{0, N};
  for (int64_t n0 = keys.begin / kBlockN * kBlockN; n0 < keys.end; n0 += kBlockN) {
    const int n_rows = static_cast<int>(N - n0 < kBlockN ? N - n0 : kBlockN);
    __syncthreads();  // the previous K/V tile has been consumed by every warp
    load_tile<kThreads, kBlockN, kHeadDim, Layout::kKStride>(k_tile, k + n0 * p.k_stride_n, p.k_stride_n, n_rows,
                                                             d, 1.0f);
    // Padded keys' value rows are zeros (their scores are replaced below, so K needs no such care).
    bool v_nonfinite = false;
    load_tile<kThreads, kBlockN, kHeadDimV, Layout::kVStride>(v_tile, v + n0 * p.v_stride_n, p.v_stride_n,
                                                              n_rows, dv, 1.0f, mask == nullptr ? nullptr : mask + n0,
                                                              kPairMasks ? &v_nonfinite : nullptr);
    if (kPairMasks) {
      v_nonfinite = __syncthreads_or(v_nonfinite) != 0;
    } else {
      __syncthreads();
    }

    // Score phase: lane j scores key n0 + j against the warp's rows.
    float s[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) s[r] = 0.0f;
#pragma unroll 1
    for (int c = 0; c < d_loop; c += 4) {
      const float4 kk = *reinterpret_cast<const float4*>(k_row + c);
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const float4 qq = *reinterpret_cast<const float4*>(q_rows + r * Layout::kQStride + c);
        s[r] = fmaf(qq.x, kk.x, fmaf(qq.y, kk.y, fmaf(qq.z, kk.z, fmaf(qq.w, kk.w, s[r]))));
      }
    }
    const bool key_valid = lane < n_rows && (mask == nullptr || mask[n0 + lane] == 0);

    // Online softmax: s[r] becomes the lane's unnormalised probability exp(s − running max).
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      bool masked = !key_valid;
      float score = key_valid ? s[r] : negative_infinity<float>();
      if (kPairMasks) {
        const int64_t m = m0 + warp * kRowsPerWarp + r;
        const float bias = key_valid && m < M ? pair_mask.bias(m, n0 + lane) : negative_infinity<float>();
        masked = is_negative_infinity(bias);
        score = masked_score(pair_mask.capped(s[r]), bias);
      }
      const float factor = online_softmax_advance(row[r], warp_max(score));
      const float prob = math_exp(score - online_softmax_shift(row[r]));
      row[r].sum += prob;
      s[r] = kPairMasks && masked ? masked_coefficient() : prob;
#pragma unroll
      for (int t = 0; t < kColsPerLane; ++t) acc[r][t] *= factor;
    }

    if (kPairMasks && v_nonfinite) {
      fwd_pv_phase<true, kRowsPerWarp, kColsPerLane, kBlockN, Layout::kVStride>(acc, s, v_tile, lane);
    } else {
      fwd_pv_phase<false, kRowsPerWarp, kColsPerLane, kBlockN, Layout::kVStride>(acc, s, v_tile, lane);
    }
  }

  // Epilogue: reduce the lane-partial sums, normalise, and write out (input dtype) and lse (fp32).
  const int64_t out_row = fwd_output_row(p, blk);
  scalar_t* __restrict__ out = static_cast<scalar_t*>(p.out) + out_row * p.Dv;
  float* __restrict__ lse = p.lse + out_row;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    OnlineSoftmaxRow<float> total = row[r];
    total.sum = warp_sum(row[r].sum);
    const OnlineSoftmaxResult<float> result = online_softmax_finish(total);
    const int64_t m = m0 + warp * kRowsPerWarp + r;
    if (m < M) {
#pragma unroll
      for (int t = 0; t < kColsPerLane; ++t) {
        const int c = t * 32 + lane;
        if (c < dv) out[m * p.Dv + c] = from_float<scalar_t>(acc[r][t] * result.inv_sum);
      }
      if (lane == 0) lse[m] = result.lse;
    }
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
