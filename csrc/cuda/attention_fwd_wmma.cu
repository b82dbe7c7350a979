// Launcher of the tensor-core forward (fp16/bf16): one instantiation per (dtype, head-dim bucket, warps
// per block), the warp counts those of attention_fwd_plan.h; kept out of attention_fwd.cu
// so each translation unit stays small to compile.
#include "attention_fwd.cuh"

#include "attention_fwd_wmma_kernel.cuh"
#include "common/launch.cuh"

namespace attn_ext {
namespace cuda {
namespace detail {
namespace {

template <typename scalar_t, int kDim, int kWarps, bool kPairMasks>
cudaError_t launch_wmma(const CrossAttentionFwdParams& p, const CrossAttentionLaunchPlan& plan, cudaStream_t stream) {
  static_assert(WmmaFwdSmemLayout<kDim, kWarps>::kBytes == cross_attention_wmma_smem_bytes(kDim, kWarps),
                "kernel shared-memory layout and launch plan disagree");
  static_assert(kWarps != kCrossAttentionWmmaWarps || cross_attention_wmma_smem_bytes(kDim, kWarps) <= kSmemSm80Bytes,
                "the preferred tile fits sm_80");
  return launch_with_smem(cross_attention_fwd_wmma_kernel<scalar_t, kDim, kWarps, kPairMasks>, plan.grid, plan.block,
                          plan.shared_memory_bytes, stream, p);
}

/// The plan's warp count, among those compiled for this bucket (cross_attention_wmma_warps_compiled).
template <typename scalar_t, int kDim>
cudaError_t launch_warps(const CrossAttentionFwdParams& p, const CrossAttentionLaunchPlan& plan, cudaStream_t stream) {
  return dispatch_tile(plan.warps, [](int warps) { return cross_attention_wmma_warps_compiled(kDim, warps); },
                       [&](auto warps) {
                         constexpr int kWarps = decltype(warps)::value;
                         // attention_fwd with causal / attn_mask takes the pair-mask instantiation.
                         return p.has_pair_masks() ? launch_wmma<scalar_t, kDim, kWarps, true>(p, plan, stream)
                                                   : launch_wmma<scalar_t, kDim, kWarps, false>(p, plan, stream);
                       });
}

}  // namespace

cudaError_t launch_cross_attention_fwd_wmma(const CrossAttentionFwdParams& p, const CrossAttentionLaunchPlan& plan,
                                            cudaStream_t stream) {
  if (!plan.tensor_cores || plan.head_dim_instantiation != plan.head_dim_v_instantiation) return cudaErrorInvalidValue;
  return dispatch_tensor_core(p.dtype, plan.head_dim_instantiation, [&](auto scalar, auto dim) {
    return launch_warps<decltype(scalar), decltype(dim)::value>(p, plan, stream);
  });
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
