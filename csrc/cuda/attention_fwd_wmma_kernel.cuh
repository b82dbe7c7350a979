// Device code of the tensor-core (WMMA) chunked cross-attention forward, fp16 and bf16 inputs with
// fp32 accumulation (fp16 from sm_70, bf16 from sm_80: see kWmmaHasFragments in wmma_tiles.cuh).
//
// One block = 16·kWarps query rows of one (batch, head) (64 in the preferred 4-warp tile, fewer where
// the device's shared memory needs it); warp w owns rows 16w..16w+15, i.e. one row of 16×16
// fragments, so everything after the K/V tile load is warp-local. Per key tile of 32:
//  1. S = Q Kᵀ with wmma (K stored row-major [key][d] is Kᵀ in column-major), stored to shared memory;
//  2. lanes 0..15 each own one row: scale, mask (a per-key flag: 0 valid, −inf padded; with kPairMasks
//     also the pair's causal / attn_mask term, common/pair_mask.cuh), online-softmax update
//     from attn_ext/online_softmax.h, P = exp(s − shift) written as 16-bit, and the row's rescale
//     factor for the accumulator;
//  3. the warp rescales its rows of O (fp32, shared memory) by those factors, then O += P V with
//     wmma, loading and storing the accumulator tile from and to O.
// Fragments are only ever used through load/store/mma/fill (their element-to-lane mapping is
// unspecified), which is also what lets the host emulator's wmma shim run this source.
//
// Included by attention_fwd_wmma.cu (nvcc) and csrc/tests/cuda_fwd_emulation_test.cpp (g++
// with csrc/tests/cuda_emulation/mma.h standing in for <mma.h>).
#pragma once

#include <cstdint>

#include "common/tile.cuh"
#include "attention_fwd_kernel.cuh"  // FwdBlock: both forward kernels split the work alike
#include "wmma_tiles.cuh"

namespace attn_ext {
namespace cuda {
namespace detail {

/// Byte offsets of the WMMA kernel's shared memory; the launcher static_asserts kBytes against
/// cross_attention_wmma_smem_bytes() so the host plan and these offsets cannot drift apart.
template <int kDim, int kWarps>
struct WmmaFwdSmemLayout {
  static constexpr int kBlockM = 16 * kWarps, kBlockN = kCrossAttentionWmmaBlockN;
  static constexpr int kHalfStride = cross_attention_wmma_half_stride(kDim);
  static constexpr int kPStride = cross_attention_wmma_half_stride(kBlockN);
  static constexpr int kSStride = cross_attention_wmma_float_stride(kBlockN);
  static constexpr int kOStride = cross_attention_wmma_float_stride(kDim);
  static constexpr std::size_t kQ = 0;
  static constexpr std::size_t kK = kQ + 2 * kBlockM * kHalfStride;
  static constexpr std::size_t kV = kK + 2 * kBlockN * kHalfStride;
  static constexpr std::size_t kP = kV + 2 * kBlockN * kHalfStride;
  static constexpr std::size_t kS = kP + 2 * kBlockM * kPStride;
  static constexpr std::size_t kO = kS + 4 * kBlockM * kSStride;
  static constexpr std::size_t kFactor = kO + 4 * kBlockM * kOStride;
  static constexpr std::size_t kBias = kFactor + 4 * kBlockM;
  static constexpr std::size_t kBytes = kBias + 4 * kBlockN;
  static_assert(kK % 32 == 0 && kV % 32 == 0 && kP % 32 == 0 && kS % 32 == 0 && kO % 32 == 0,
                "wmma tiles need 256-bit aligned pointers");
};

/// One block of the kernel below, for the architectures whose WMMA takes scalar_t.
template <typename scalar_t, int kDim, int kWarps, bool kPairMasks>
__device__ __forceinline__ void cross_attention_fwd_wmma_block(const CrossAttentionFwdParams& p) {
  using L = WmmaFwdSmemLayout<kDim, kWarps>;
  constexpr int kThreads = kWarps * 32;
  constexpr int kBlockM = L::kBlockM, kBlockN = L::kBlockN;
  static_assert(kDim % 16 == 0 && kBlockN % 16 == 0, "wmma tiles are 16×16");

  // The kernel has no static shared memory, so the dynamic buffer starts at the block's shared window
  // base, aligned well beyond the 32 bytes wmma needs; the section offsets keep that (see the layout).
  extern __shared__ float4 smem_raw[];
  char* smem = reinterpret_cast<char*>(smem_raw);
  scalar_t* q_tile = reinterpret_cast<scalar_t*>(smem + L::kQ);
  scalar_t* k_tile = reinterpret_cast<scalar_t*>(smem + L::kK);
  scalar_t* v_tile = reinterpret_cast<scalar_t*>(smem + L::kV);
  scalar_t* p_tile = reinterpret_cast<scalar_t*>(smem + L::kP);
  float* s_tile = reinterpret_cast<float*>(smem + L::kS);
  float* o_tile = reinterpret_cast<float*>(smem + L::kO);
  float* row_factor = reinterpret_cast<float*>(smem + L::kFactor);
  float* key_bias = reinterpret_cast<float*>(smem + L::kBias);

  const FwdBlock<scalar_t> blk = fwd_block<scalar_t>(p, kBlockM);  // same block order as the SIMT kernel
  const int64_t m0 = blk.m0, M = blk.M, N = blk.N;
  if (m0 >= M) return;  // a packed sequence shorter than the longest (block-uniform: before any barrier)
  const int d = static_cast<int>(p.D), dv = static_cast<int>(p.Dv);

  const int64_t m_rows = M - m0;
  copy_tile<kThreads, kBlockM, kDim, L::kHalfStride>(q_tile, blk.q + m0 * p.q_stride_m, p.q_stride_m,
                                                     static_cast<int>(m_rows < kBlockM ? m_rows : kBlockM), d);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int row0 = warp * 16;
  for (int idx = lane; idx < 16 * kDim; idx += 32) o_tile[(row0 + idx / kDim) * L::kOStride + idx % kDim] = 0.0f;

  OnlineSoftmaxRow<float> row = online_softmax_empty<float>();  // meaningful in lanes 0..15 (row row0 + lane)
  const PairMaskHead<scalar_t> pair_mask = pair_mask_head<scalar_t>(p, blk.b, blk.h, blk.shift);
  // The key tiles the causal rule and the band leave to the block's rows (all without pair masks).
  const IndexRange keys = kPairMasks ? band_keys(p, m0, m0 + kBlockM, N, blk.shift) : IndexRange{0, N};
  for (int64_t n0 = keys.begin / kBlockN * kBlockN; n0 < keys.end; n0 += kBlockN) {
    const int n_rows = static_cast<int>(N - n0 < kBlockN ? N - n0 : kBlockN);
    __syncthreads();  // every warp is done with the previous K/V tile (and the Q tile is complete)
    // Padded keys are zero rows: the P·V product would take 0 · NaN from a padded value, and the
    // score of a padded key must not depend on what it holds.
    const uint8_t* tile_padding = blk.mask == nullptr ? nullptr : blk.mask + n0;
    copy_tile<kThreads, kBlockN, kDim, L::kHalfStride>(k_tile, blk.k + n0 * p.k_stride_n, p.k_stride_n, n_rows, d,
                                                       tile_padding);
    bool v_nonfinite = false;
    copy_tile<kThreads, kBlockN, kDim, L::kHalfStride>(v_tile, blk.v + n0 * p.v_stride_n, p.v_stride_n, n_rows, dv,
                                                       tile_padding, kPairMasks ? &v_nonfinite : nullptr);
    for (int j = threadIdx.x; j < kBlockN; j += kThreads) {
      const bool valid = j < n_rows && (blk.mask == nullptr || blk.mask[n0 + j] == 0);
      key_bias[j] = valid ? 0.0f : negative_infinity<float>();
    }
    if (kPairMasks) {
      v_nonfinite = __syncthreads_or(v_nonfinite) != 0;  // block-uniform: the P·V branch below
    } else {
      __syncthreads();
    }

    // 1. S (unscaled) = Q Kᵀ for the warp's 16 rows.
    warp_gemm_abt<scalar_t, kDim, kBlockN>(s_tile + row0 * L::kSStride, L::kSStride, q_tile + row0 * L::kHalfStride,
                                           k_tile, L::kHalfStride);
    __syncwarp();

    // 2. Online softmax, one lane per row. Scaling in fp32 here (not pre-scaling the 16-bit Q) keeps
    // the scores as exact as the fp32 accumulation.
    if (lane < 16) {
      float* s_row = s_tile + (row0 + lane) * L::kSStride;
      const int64_t m = m0 + row0 + lane;
      float block_max = negative_infinity<float>();
      uint32_t masked_keys = 0;  // pair masks: bit j = key n0 + j is masked for this row (kBlockN = 32)
#pragma unroll 8
      for (int j = 0; j < kBlockN; ++j) {
        // Selected, not added: a NaN query row times a padded (zeroed) key is NaN, and NaN + (−inf)
        // would make a row without valid keys NaN instead of empty.
        float score = key_bias[j] == 0.0f ? s_row[j] * p.scale : negative_infinity<float>();
        if (kPairMasks) {
          const float bias = key_bias[j] == 0.0f && m < M ? pair_mask.bias(m, n0 + j) : negative_infinity<float>();
          if (is_negative_infinity(bias)) masked_keys |= 1u << j;
          score = masked_score(pair_mask.capped(score), bias);
        }
        s_row[j] = score;
        block_max = fmaxf(block_max, score);
      }
      const float factor = online_softmax_advance(row, block_max);
      const float shift = online_softmax_shift(row);
      float sum = 0.0f;
#pragma unroll 8
      for (int j = 0; j < kBlockN; ++j) {
        const float prob = math_exp(s_row[j] - shift);
        sum += prob;
        const bool masked = kPairMasks && ((masked_keys >> j) & 1u) != 0;
        p_tile[(row0 + lane) * L::kPStride + j] = from_float<scalar_t>(masked ? masked_coefficient() : prob);
      }
      row.sum += sum;
      row_factor[row0 + lane] = factor;
    }
    __syncwarp();

    // 3. O = factor·O + P V.
    for (int idx = lane; idx < 16 * kDim; idx += 32) {
      const int r = row0 + idx / kDim;
      o_tile[r * L::kOStride + idx % kDim] *= row_factor[r];
    }
    __syncwarp();
    if (kPairMasks && v_nonfinite) {
      warp_gemm_acc_exact<scalar_t, kDim, kBlockN>(o_tile + row0 * L::kOStride, L::kOStride,
                                                   p_tile + row0 * L::kPStride, L::kPStride, v_tile, L::kHalfStride,
                                                   lane);
    } else {
      warp_gemm_acc<scalar_t, kDim, kBlockN>(o_tile + row0 * L::kOStride, L::kOStride, p_tile + row0 * L::kPStride,
                                             L::kPStride, v_tile, L::kHalfStride);
    }
  }

  // Epilogue: normalise and write out (input dtype) and lse (fp32); an empty row gets 0 and −inf.
  __syncwarp();
  const int64_t out_row = fwd_output_row(p, blk);
  scalar_t* __restrict__ out = static_cast<scalar_t*>(p.out) + out_row * p.Dv;
  if (lane < 16) {
    const OnlineSoftmaxResult<float> result = online_softmax_finish(row);
    row_factor[row0 + lane] = result.inv_sum;
    if (m0 + row0 + lane < M) p.lse[out_row + m0 + row0 + lane] = result.lse;
  }
  __syncwarp();
  for (int idx = lane; idx < 16 * kDim; idx += 32) {
    const int r = row0 + idx / kDim, c = idx % kDim;
    const int64_t m = m0 + r;
    if (m < M && c < dv) out[m * p.Dv + c] = from_float<scalar_t>(o_tile[r * L::kOStride + c] * row_factor[r]);
  }
}

/// Launched with kWarps·32 threads, WmmaFwdSmemLayout<kDim, kWarps>::kBytes of dynamic shared memory,
/// over the 1-D grid of attention_fwd_plan.h. kDim ≥ max(D, Dv). kPairMasks: the attention_fwd
/// instantiation (causal / attn_mask read per pair, exact P·V for a V tile with inf or NaN).
template <typename scalar_t, int kDim, int kWarps, bool kPairMasks = false>
__global__ void __launch_bounds__(kWarps * 32, 1) cross_attention_fwd_wmma_kernel(const CrossAttentionFwdParams p) {
  if constexpr (kWmmaHasFragments<scalar_t>) {
    cross_attention_fwd_wmma_block<scalar_t, kDim, kWarps, kPairMasks>(p);
  } else {
    __trap();  // bf16 below sm_80: the plans refuse it before launching (wmma_tiles.cuh)
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
