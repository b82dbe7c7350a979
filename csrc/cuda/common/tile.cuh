// Block-wide copies of a [rows, cols] tile from global into shared memory, zero outside the valid
// corner so that padded rows and head-dimension tails add nothing to the products that read the tile.
// Consecutive threads take consecutive columns, so the global loads coalesce.
#pragma once

#include <cstdint>
#include <math.h>

#include <cuda_runtime.h>

#include "dtypes.cuh"

namespace attn_ext {
namespace cuda {
namespace detail {

/// The tile as fp32, multiplied by `mul` (the SIMT kernels convert once on load, since every element
/// is then read by all rows of the block). kCols is a power of two, so the index split is a shift.
/// `padding` (null, or one flag per tile row, nonzero = padded key) zeroes rows too: a padded key is
/// never read, since its probability 0 times a NaN it might hold would be NaN in every query row.
/// `nonfinite` (null, or this thread's flag): set when an element this thread loaded is inf or NaN
/// (the pair-mask kernels then take their exact products for the tile, common/pair_mask.cuh).
template <int kThreads, int kRows, int kCols, int kDstStride, typename scalar_t>
__device__ __forceinline__ void load_tile(float* __restrict__ dst, const scalar_t* __restrict__ src,
                                          int64_t row_stride, int rows_valid, int cols_valid, float mul,
                                          const uint8_t* __restrict__ padding = nullptr, bool* nonfinite = nullptr) {
#pragma unroll 4
  for (int idx = threadIdx.x; idx < kRows * kCols; idx += kThreads) {
    const int r = idx / kCols;
    const int c = idx % kCols;
    float value = 0.0f;
    if (r < rows_valid && c < cols_valid && (padding == nullptr || padding[r] == 0)) {
      value = to_float(src[r * row_stride + c]) * mul;
    }
    if (nonfinite != nullptr && !isfinite(value)) *nonfinite = true;
    dst[r * kDstStride + c] = value;
  }
}

/// The tile as is, in its 16-bit storage type (the tensor-core kernels' operands); `padding` as above.
template <int kThreads, int kRows, int kCols, int kStride, typename scalar_t>
__device__ __forceinline__ void copy_tile(scalar_t* __restrict__ dst, const scalar_t* __restrict__ src,
                                          int64_t row_stride, int rows_valid, int cols_valid,
                                          const uint8_t* __restrict__ padding = nullptr, bool* nonfinite = nullptr) {
  const scalar_t zero = from_float<scalar_t>(0.0f);
#pragma unroll 4
  for (int idx = threadIdx.x; idx < kRows * kCols; idx += kThreads) {
    const int r = idx / kCols;
    const int c = idx % kCols;
    const bool read = r < rows_valid && c < cols_valid && (padding == nullptr || padding[r] == 0);
    const scalar_t value = read ? src[r * row_stride + c] : zero;
    if (nonfinite != nullptr && !isfinite(to_float(value))) *nonfinite = true;
    dst[r * kStride + c] = value;
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
