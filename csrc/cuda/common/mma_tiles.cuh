// Tile-level helpers of the mma.sync kernels (attention_fwd_mma_kernel.cuh, attention_bwd_mma_kernel.cuh),
// on the primitives and fragment layouts of common/mma_sm80.cuh:
//  * block-cooperative 16-byte cp.async of a row-major tile into shared memory, zero-filling what is
//    not read, and the check of such a tile for inf/NaN;
//  * the reuse of a C fragment pair (two adjacent 8-column blocks of fp32 results) as one 16-column A
//    fragment of 16-bit values, which keeps P and dS in registers between two products;
//  * the exact scalar product that replaces an MMA when masked coefficients meet inf/NaN operands.
#pragma once

#include <cstdint>

#include "common/dtypes.cuh"
#include "common/mma_sm80.cuh"
#include "common/pair_mask.cuh"

namespace attn_ext {
namespace cuda {
namespace detail {

/// Issues the cp.async of rows [0, kRows) of a row-major tile (row stride `stride` elements, `cols`
/// valid columns, a multiple of 8) into shared memory with row stride kStride; rows ≥ rows_valid,
/// padded rows (padding[r] != 0) and columns ≥ cols are zero-filled without reading global memory.
template <int kThreads, int kRows, int kChunks, int kStride, typename scalar_t>
__device__ __forceinline__ void load_tile_async(scalar_t* dst, const scalar_t* src, int64_t stride, int rows_valid,
                                                int cols, const uint8_t* padding) {
#pragma unroll
  for (int idx = threadIdx.x; idx < kRows * kChunks; idx += kThreads) {
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    const bool valid = r < rows_valid && c < cols && (padding == nullptr || padding[r] == 0);
    cp_async_16(dst + r * kStride + c, valid ? src + r * stride + c : src, valid);
  }
}

/// Whether any element of the pieces this thread loaded by load_tile_async (same geometry) is inf or
/// NaN; read from shared memory after this thread's cp.async wait (its own copies are visible to it).
template <int kThreads, int kRows, int kChunks, int kStride, typename scalar_t>
__device__ __forceinline__ bool tile_has_nonfinite(const scalar_t* tile) {
  bool nonfinite = false;
  for (int idx = threadIdx.x; idx < kRows * kChunks; idx += kThreads) {
    const scalar_t* piece = tile + (idx / kChunks) * kStride + (idx % kChunks) * 8;
#pragma unroll
    for (int e = 0; e < 8; ++e) nonfinite |= !isfinite(to_float(piece[e]));
  }
  return nonfinite;
}

/// The A fragment (16 rows × 16 columns, 16-bit) made of C fragments `lo` (columns 0-7) and `hi`
/// (columns 8-15) of the same 16 rows: the layouts line up register for register.
template <typename scalar_t>
__device__ __forceinline__ MmaA c_pair_as_a(const MmaC& lo, const MmaC& hi) {
  return MmaA{{pack_pair<scalar_t>(lo.r[0], lo.r[1]), pack_pair<scalar_t>(lo.r[2], lo.r[3]),
               pack_pair<scalar_t>(hi.r[0], hi.r[1]), pack_pair<scalar_t>(hi.r[2], hi.r[3])}};
}

/// acc[16 × 8·kDB] += coef[16 × 8·kNB] · rows[8·kNB × 8·kDB] by scalar FMAs that skip masked
/// coefficients (the −0.0 marker of pair_mask.cuh), for a tile whose rows hold inf or NaN: an MMA would
/// turn a masked pair's 0 · inf into NaN. coef is a row of C fragments held by the warp (each value
/// rounded to scalar_t, as the MMA path rounds it, and fetched by shuffle from the quad lane holding
/// it); rows is row-major in shared memory. Warp-collective.
template <typename scalar_t, int kNB, int kDB>
__device__ __forceinline__ void exact_tile_acc(MmaC (&acc)[kDB], const MmaC (&coef)[kNB], const scalar_t* rows,
                                               int stride) {
  const int lane = threadIdx.x % 32, t = lane % 4;
#pragma unroll 1
  for (int j = 0; j < 8 * kNB; ++j) {
    const int src = (lane & ~3) | ((j % 8) / 2);
    float probs[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mine = 0.0f;
#pragma unroll
      for (int nb = 0; nb < kNB; ++nb) {
        // Selected with compile-time register indices: a runtime index would put coef in local memory.
        const float pick = (j & 1) != 0 ? coef[nb].r[2 * h + 1] : coef[nb].r[2 * h];
        mine = nb == j / 8 ? pick : mine;
      }
      const float c = __shfl_sync(0xffffffffu, mine, src);
      probs[h] = is_masked_coefficient(c) ? c : to_float(from_float<scalar_t>(c));
    }
    const scalar_t* row = rows + j * stride;
#pragma unroll
    for (int db = 0; db < kDB; ++db) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float x = to_float(row[8 * db + 2 * t + e]);
        acc[db].r[e] = masked_fma(probs[0], x, acc[db].r[e]);
        acc[db].r[2 + e] = masked_fma(probs[1], x, acc[db].r[2 + e]);
      }
    }
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
