// Launcher of the tensor-core backward kernels (fp16/bf16): 2 dtypes × 4 head-dim buckets × {dK/dV, dQ}.
#include "cross_attention_bwd.cuh"

#include "cross_attention_bwd_wmma_kernel.cuh"
#include "common/launch.cuh"

namespace attn_ext {
namespace cuda {
namespace detail {
namespace {

template <typename scalar_t, int kDim>
cudaError_t launch_dim(const CrossAttentionBwdParams& p, const CrossAttentionBwdPlan& plan, cudaStream_t stream) {
  static_assert(cross_attention_bwd_wmma_smem(kDim, true).bytes <= 163 * 1024, "fits sm_80's opt-in limit");
  if (plan.dkdv_grid.x > 0) {
    const cudaError_t err = launch_with_smem(cross_attention_bwd_wmma_kernel<scalar_t, kDim, true>, plan.dkdv_grid,
                                             plan.block, plan.dkdv_smem_bytes, stream, p);
    if (err != cudaSuccess) return err;
  }
  if (plan.dq_grid.x == 0) return cudaSuccess;
  return launch_with_smem(cross_attention_bwd_wmma_kernel<scalar_t, kDim, false>, plan.dq_grid, plan.block,
                          plan.dq_smem_bytes, stream, p);
}

}  // namespace

cudaError_t launch_cross_attention_bwd_wmma(const CrossAttentionBwdParams& p, const CrossAttentionBwdPlan& plan,
                                            cudaStream_t stream) {
  if (!plan.tensor_cores) return cudaErrorInvalidValue;
  return dispatch_tensor_core(p.dtype, plan.dim, [&](auto scalar, auto dim) {
    return launch_dim<decltype(scalar), decltype(dim)::value>(p, plan, stream);
  });
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
