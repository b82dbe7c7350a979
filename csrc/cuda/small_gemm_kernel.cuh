// A strided batched GEMM for the small per-(batch, head) products of Intention (docs/spec.md §4):
//     C[b,h] = alpha·A[b,h]·B[b,h] + alpha2·A2[b,h]·B2[b,h]      (second term optional)
// with any element strides (so transposes are views: Kᵀ is K with its strides swapped), fp32
// accumulation, an optional key-padding mask on the reduction index of the first term (the Gram
// statistics skip padding keys: their loads are replaced by 0, never multiplied) and an optional
// mask on the output rows (gradients of padding keys are written as 0).
//
// One block computes a 32×32 tile of C; A and B stream through shared memory in 32-deep steps.
// Tiles are read along whichever of the two strides is 1, so both K and Kᵀ loads coalesce.
// Deliberately simple (CUDA cores, no tensor cores): the matrices are at most D×(D + Dv) with
// D, Dv ≤ 128 per head, and the products with M or N rows are memory-bound.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "common/dtypes.cuh"
#include "small_gemm.h"

namespace attn_ext {
namespace cuda {

namespace detail {

constexpr int kGemmLd = kSmallGemmTile + 1;

/// Loads the 32×32 tile at (r0, c0) of `op` (of (b, h)) as fp32, 0 outside rows × cols; `skip_row` /
/// `skip_col` (nullable) mark masked rows / columns of the tile's operand, also loaded as 0.
template <typename T>
__device__ __forceinline__ void gemm_load_tile(float* dst, const GemmOperand& op, int64_t b, int64_t h, int64_t r0,
                                               int64_t c0, int64_t rows, int64_t cols, const uint8_t* skip_row,
                                               const uint8_t* skip_col) {
  const T* base = static_cast<const T*>(op.data) + b * op.stride_b + h * op.stride_h;
  // Consecutive threads walk the unit-stride dimension, so the global loads coalesce.
  const bool rows_fast = op.stride_row == 1 && op.stride_col != 1;
  for (int idx = static_cast<int>(threadIdx.x); idx < kSmallGemmTile * kSmallGemmTile; idx += kSmallGemmThreads) {
    const int fast = idx % kSmallGemmTile, slow = idx / kSmallGemmTile;
    const int r = rows_fast ? fast : slow, c = rows_fast ? slow : fast;
    const int64_t gr = r0 + r, gc = c0 + c;
    float value = 0.0f;
    if (gr < rows && gc < cols && (skip_row == nullptr || skip_row[gr] == 0) &&
        (skip_col == nullptr || skip_col[gc] == 0)) {
      value = to_float(base[gr * op.stride_row + gc * op.stride_col]);
    }
    dst[r * kGemmLd + c] = value;
  }
}

/// acc[t] (rows ty + 8t of the tile, column tx) = Σ_k A(i, k) B(k, j) over `inner`.
template <typename TA, typename TB>
__device__ __forceinline__ void gemm_accumulate(float (&acc)[4], float* as, float* bs, const GemmOperand& a,
                                                const GemmOperand& b, int64_t bi, int64_t h, int64_t i0, int64_t j0,
                                                int64_t rows, int64_t cols, int64_t inner, const uint8_t* inner_mask) {
  const int tx = static_cast<int>(threadIdx.x) % kSmallGemmTile, ty = static_cast<int>(threadIdx.x) / kSmallGemmTile;
  for (int64_t k0 = 0; k0 < inner; k0 += kSmallGemmTile) {
    __syncthreads();  // the previous step's tiles are consumed
    gemm_load_tile<TA>(as, a, bi, h, i0, k0, rows, inner, nullptr, inner_mask);
    gemm_load_tile<TB>(bs, b, bi, h, k0, j0, inner, cols, inner_mask, nullptr);
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < kSmallGemmTile; ++kk) {
      const float bv = bs[kk * kGemmLd + tx];
#pragma unroll
      for (int t = 0; t < 4; ++t) acc[t] = fmaf(as[(ty + 8 * t) * kGemmLd + kk], bv, acc[t]);
    }
  }
}

/// Launched over the grid of plan_small_gemm() with kSmallGemmThreads threads and
/// small_gemm_smem_bytes() of dynamic shared memory.
/// The minimum of 2 blocks per SM (a register budget of 128) matters: with the block size alone,
/// ptxas (CUDA 13) held the fp16/bf16 instantiations to 64 registers on sm_90 and spilled.
template <typename TA, typename TB, typename TC>
__global__ void __launch_bounds__(kSmallGemmThreads, 2) small_gemm_kernel(const SmallGemmParams p) {
  extern __shared__ float4 smem_raw[];
  float* as = reinterpret_cast<float*>(smem_raw);
  float* bs = as + kSmallGemmTile * kGemmLd;
  const unsigned int row_tiles = static_cast<unsigned int>((p.rows + kSmallGemmTile - 1) / kSmallGemmTile);
  const int64_t bh = blockIdx.x / row_tiles;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x % row_tiles) * kSmallGemmTile;
  const int64_t j0 = static_cast<int64_t>(blockIdx.y) * kSmallGemmTile;
  const int64_t bi = static_cast<unsigned int>(bh) / static_cast<unsigned int>(p.heads);
  const int64_t h = static_cast<unsigned int>(bh) % static_cast<unsigned int>(p.heads);
  const uint8_t* inner_mask = p.inner_mask == nullptr ? nullptr : p.inner_mask + bi * p.inner_mask_stride_b;

  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  gemm_accumulate<TA, TB>(acc, as, bs, p.a, p.b, bi, h, i0, j0, p.rows, p.cols, p.inner, inner_mask);
  float result[4];
#pragma unroll
  for (int t = 0; t < 4; ++t) result[t] = p.alpha * acc[t];
  if (p.a2.data != nullptr) {  // grid-uniform, so the barriers inside stay uniform
#pragma unroll
    for (int t = 0; t < 4; ++t) acc[t] = 0.0f;
    gemm_accumulate<TA, TB>(acc, as, bs, p.a2, p.b2, bi, h, i0, j0, p.rows, p.cols, p.inner2, nullptr);
#pragma unroll
    for (int t = 0; t < 4; ++t) result[t] = fmaf(p.alpha2, acc[t], result[t]);
  }

  const int tx = static_cast<int>(threadIdx.x) % kSmallGemmTile, ty = static_cast<int>(threadIdx.x) / kSmallGemmTile;
  const int64_t j = j0 + tx;
  const uint8_t* row_mask = p.row_mask == nullptr ? nullptr : p.row_mask + bi * p.row_mask_stride_b;
  TC* c = static_cast<TC*>(p.c) + bi * p.c_stride_b + h * p.c_stride_h;
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const int64_t i = i0 + ty + 8 * t;
    if (i < p.rows && j < p.cols) {
      const bool zero = row_mask != nullptr && row_mask[i] != 0;
      c[i * p.c_stride_row + j] = from_float<TC>(zero ? 0.0f : result[t]);
    }
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
