// Launch of the tensor-core backward kernels (fp16/bf16) for one dtype, declared in
// attention_bwd.cuh: the plan's head-dim bucket and warp count to their instantiation, {dK/dV,
// dQ} × the 8 (bucket, warps) tiles of attention_bwd_plan.h (the preferred tile of each bucket
// and 4 fall-backs). One .cu file per dtype instantiates it (cross_attention_bwd_wmma_{fp16,bf16}.cu),
// so that the two halves of the project's largest set of kernels compile in parallel.
#pragma once

#include "attention_bwd.cuh"
#include "attention_bwd_wmma_kernel.cuh"
#include "common/launch.cuh"

namespace attn_ext {
namespace cuda {
namespace detail {

template <typename scalar_t, int kDim, int kWarps, bool kPairMasks>
cudaError_t launch_bwd_wmma_tile(const CrossAttentionBwdParams& p, const CrossAttentionBwdPlan& plan,
                                 cudaStream_t stream) {
  static_assert(kWarps != cross_attention_bwd_wmma_preferred_warps(kDim) ||
                    cross_attention_bwd_wmma_smem(kDim, kWarps, true).bytes <= kSmemSm80Bytes,
                "the preferred tile fits sm_80");
  static_assert(cross_attention_bwd_wmma_smem(kDim, kWarps, false).bytes <=
                    cross_attention_bwd_wmma_smem(kDim, kWarps, true).bytes,
                "the plan sizes the warps by the dK/dV kernel, the larger");
  if (plan.dkdv_grid.x > 0) {
    const cudaError_t err = launch_with_smem(cross_attention_bwd_wmma_kernel<scalar_t, kDim, kWarps, true, kPairMasks>,
                                             plan.dkdv_grid, plan.block, plan.dkdv_smem_bytes, stream, p);
    if (err != cudaSuccess) return err;
  }
  if (plan.dq_grid.x == 0) return cudaSuccess;
  return launch_with_smem(cross_attention_bwd_wmma_kernel<scalar_t, kDim, kWarps, false, kPairMasks>, plan.dq_grid,
                          plan.block, plan.dq_smem_bytes, stream, p);
}

template <typename scalar_t>
cudaError_t launch_cross_attention_bwd_wmma(const CrossAttentionBwdParams& p, const CrossAttentionBwdPlan& plan,
                                            cudaStream_t stream) {
  if (!plan.tensor_cores) return cudaErrorInvalidValue;
  return dispatch_head_dim_bucket(plan.dim, [&](auto bucket) {
    constexpr int kDim = decltype(bucket)::value;
    return dispatch_tile(plan.warps, [](int warps) { return cross_attention_bwd_wmma_warps_compiled(kDim, warps); },
                         [&](auto warps) {
                           constexpr int kWarps = decltype(warps)::value;
                           // attention_bwd with causal / attn_mask takes the pair-mask instantiations.
                           return p.has_pair_masks() ? launch_bwd_wmma_tile<scalar_t, kDim, kWarps, true>(p, plan, stream)
                                                     : launch_bwd_wmma_tile<scalar_t, kDim, kWarps, false>(p, plan, stream);
                         });
  });
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
