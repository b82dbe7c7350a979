// Warp-wide reductions. Butterfly (xor) shuffles, so every lane ends with the same value, bitwise:
// kernels branch on the result without diverging.
#pragma once

#include <cuda_runtime.h>

namespace attn_ext {
namespace cuda {
namespace detail {

constexpr unsigned int kFullWarpMask = 0xffffffffu;

/// Maximum over the warp; fmaxf keeps −inf as the identity, which is what masked keys contribute.
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    x = fmaxf(x, __shfl_xor_sync(kFullWarpMask, x, offset));
  }
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(kFullWarpMask, x, offset);
  }
  return x;
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
