// The one Intention-specific kernel: dα = −Σ dB ⊙ W per (batch, head), a block reduction. The rest
// of the Intention chain (intention_plan.h) runs the generic GEMM and Cholesky kernels.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "common/warp.cuh"
#include "intention_plan.h"

namespace attn_ext {
namespace cuda {
namespace detail {

/// One block of kNegatedDotThreads per item. Fixed reduction order (strided partials, warp trees,
/// then the warps in order), so the result is deterministic.
__global__ void __launch_bounds__(kNegatedDotThreads) negated_dot_kernel(const NegatedDotParams p) {
  extern __shared__ float4 smem_raw[];
  float* warp_sums = reinterpret_cast<float*>(smem_raw);
  const int64_t m = blockIdx.x;
  const float* a = p.a + m * p.size;
  const float* b = p.b + m * p.size;
  float partial = 0.0f;
  for (int64_t i = threadIdx.x; i < p.size; i += kNegatedDotThreads) partial = fmaf(a[i], b[i], partial);
  partial = warp_sum(partial);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = partial;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int w = 0; w < kNegatedDotThreads / 32; ++w) total += warp_sums[w];
    p.out[m] = -total;
  }
}

constexpr std::size_t kNegatedDotSmemBytes = sizeof(float) * (kNegatedDotThreads / 32);

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
