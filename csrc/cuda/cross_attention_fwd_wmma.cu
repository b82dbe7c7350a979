// Launcher of the tensor-core forward (fp16/bf16): one instantiation per (dtype, head-dim bucket),
// kept out of cross_attention_fwd.cu so each translation unit stays small to compile.
#include "cross_attention_fwd.cuh"

#include "cross_attention_fwd_wmma_kernel.cuh"
#include "common/launch.cuh"

namespace attn_ext {
namespace cuda {
namespace detail {
namespace {

template <typename scalar_t, int kDim>
cudaError_t launch_wmma(const CrossAttentionFwdParams& p, const CrossAttentionLaunchPlan& plan, cudaStream_t stream) {
  static_assert(WmmaFwdSmemLayout<kDim>::kBytes == cross_attention_wmma_smem_bytes(kDim),
                "kernel shared-memory layout and launch plan disagree");
  return launch_with_smem(cross_attention_fwd_wmma_kernel<scalar_t, kDim>, plan.grid, plan.block,
                          plan.shared_memory_bytes, stream, p);
}

}  // namespace

cudaError_t launch_cross_attention_fwd_wmma(const CrossAttentionFwdParams& p, const CrossAttentionLaunchPlan& plan,
                                            cudaStream_t stream) {
  if (!plan.tensor_cores || plan.head_dim_instantiation != plan.head_dim_v_instantiation) return cudaErrorInvalidValue;
  return dispatch_tensor_core(p.dtype, plan.head_dim_instantiation, [&](auto scalar, auto dim) {
    return launch_wmma<decltype(scalar), decltype(dim)::value>(p, plan, stream);
  });
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
