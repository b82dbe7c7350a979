// Device code of the state merge: one thread per output element, each recomputing its row's weights
// (a few flops, cheaper than sharing them through shared memory for a memory-bound op). The thread
// of column 0 also writes the row's lse. Included by merge_states.cu and the emulation test.
#pragma once

#include <cstdint>

#include "attn_ext/online_softmax.h"
#include "common/dtypes.cuh"
#include "merge_states.cuh"

namespace attn_ext {
namespace cuda {
namespace detail {

template <typename scalar_t>
__global__ void __launch_bounds__(kMergeStatesThreads) merge_states_fwd_kernel(const MergeStatesParams p) {
  const int64_t cols = p.Dv > 0 ? p.Dv : 1;  // Dv = 0 still has lse to merge
  const int64_t total = p.rows * cols;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t row = i / cols, c = i % cols;
    const StateMergeWeights<float> w = state_merge_weights(p.lse_a[row], p.lse_b[row]);
    if (c == 0) p.lse[row] = w.lse;
    if (p.Dv > 0) {
      const float a = to_float(static_cast<const scalar_t*>(p.out_a)[i]);
      const float b = to_float(static_cast<const scalar_t*>(p.out_b)[i]);
      static_cast<scalar_t*>(p.out)[i] = from_float<scalar_t>(fmaf(w.weight_a, a, w.weight_b * b));
    }
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
