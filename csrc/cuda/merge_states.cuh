// Host-side interface and launch plan of the CUDA merge of two attention states (docs/spec.md §1 merge,
// the op attn_ext::merge_states_fwd): out = w_a·o_a + w_b·o_b, lse = logaddexp(lse_a, lse_b),
// the weights from state_merge_weights() in attn_ext/online_softmax.h. The plan is plain C++.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/launch_geometry.h"

namespace attn_ext {
namespace cuda {

/// Rows × Dv states, every tensor contiguous ([rows, Dv] and [rows]); out_* share `dtype`, lse_* fp32.
struct MergeStatesParams {
  const void* out_a = nullptr;
  const float* lse_a = nullptr;
  const void* out_b = nullptr;
  const float* lse_b = nullptr;
  void* out = nullptr;
  float* lse = nullptr;
  int64_t rows = 0, Dv = 0;
  ScalarType dtype = ScalarType::kFloat32;
};

constexpr int kMergeStatesThreads = 256;
/// Grid-stride loop beyond this many blocks: the merge is memory bound, more blocks add nothing.
constexpr int64_t kMergeStatesMaxBlocks = int64_t(1) << 16;

struct MergeStatesPlan {
  bool supported = false;
  const char* error = nullptr;
  LaunchDims grid;  ///< x = 0: nothing to do
  LaunchDims block;
};

/// One thread per output element (rows·Dv, grid-stride), plus the lse of rows with Dv = 0.
inline MergeStatesPlan plan_merge_states(int64_t rows, int64_t Dv, ScalarType dtype) {
  MergeStatesPlan plan;
  if (!is_attention_dtype(dtype)) {
    plan.error = kAttentionDtypeError;
    return plan;
  }
  if (rows < 0 || Dv < 0 || (Dv > 0 && rows > INT64_MAX / Dv)) {
    plan.error = "invalid size";
    return plan;
  }
  const int64_t elements = rows * (Dv > 0 ? Dv : 1);
  const int64_t blocks = (elements + kMergeStatesThreads - 1) / kMergeStatesThreads;
  plan.grid.x = static_cast<unsigned int>(blocks < kMergeStatesMaxBlocks ? blocks : kMergeStatesMaxBlocks);
  plan.block.x = kMergeStatesThreads;
  plan.supported = true;
  return plan;
}

/// Enqueues the merge on `stream`. cudaErrorInvalidValue for bad sizes, dtype or null pointers.
cudaError_t launch_merge_states_fwd(const MergeStatesParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace attn_ext
