// Launcher of the state merge (one instantiation per dtype).
#include "merge_states.cuh"

#include "common/launch.cuh"
#include "merge_states_kernel.cuh"

namespace attn_ext {
namespace cuda {

cudaError_t launch_merge_states_fwd(const MergeStatesParams& p, cudaStream_t stream) {
  const MergeStatesPlan plan = plan_merge_states(p.rows, p.Dv, p.dtype);
  if (!plan.supported) return cudaErrorInvalidValue;
  if (plan.grid.x == 0) return cudaSuccess;
  if (p.lse_a == nullptr || p.lse_b == nullptr || p.lse == nullptr ||
      (p.Dv > 0 && (p.out_a == nullptr || p.out_b == nullptr || p.out == nullptr))) {
    return cudaErrorInvalidValue;
  }
  return detail::dispatch_attention_dtype(p.dtype, [&](auto scalar) {
    return detail::launch_with_smem(detail::merge_states_fwd_kernel<decltype(scalar)>, plan.grid, plan.block, 0,
                                    stream, p);
  });
}

}  // namespace cuda
}  // namespace attn_ext
