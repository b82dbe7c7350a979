// Launcher of the cross-attention backward: the Δ pre-pass, then dK/dV and dQ (independent of each
// other, both reading Δ): SIMT kernels for fp32 (16- and 8-row tiles), the tensor-core kernels of
// cross_attention_bwd_wmma_{fp16,bf16}.cu for fp16/bf16.
#include "attention_bwd.cuh"

#include <type_traits>

#include "attention_bwd_kernel.cuh"
#include "common/device_limits.h"
#include "common/launch.cuh"

namespace attn_ext {
namespace cuda {
namespace {

template <int kTile, bool kPairMasks>
cudaError_t launch_simt_kernels(const CrossAttentionBwdParams& p, const CrossAttentionBwdPlan& plan,
                                cudaStream_t stream) {
  if (plan.dkdv_grid.x > 0) {
    const cudaError_t err = detail::launch_with_smem(detail::cross_attention_bwd_dkdv_kernel<float, kTile, kPairMasks>,
                                                     plan.dkdv_grid, plan.block, plan.dkdv_smem_bytes, stream, p);
    if (err != cudaSuccess) return err;
  }
  if (plan.dq_grid.x == 0) return cudaSuccess;
  return detail::launch_with_smem(detail::cross_attention_bwd_dq_kernel<float, kTile, kPairMasks>, plan.dq_grid,
                                  plan.block, plan.dq_smem_bytes, stream, p);
}

/// attention_bwd with causal / attn_mask takes the pair-mask instantiations.
template <int kTile>
cudaError_t launch_simt_tile(const CrossAttentionBwdParams& p, const CrossAttentionBwdPlan& plan, cudaStream_t stream) {
  return p.has_pair_masks() ? launch_simt_kernels<kTile, true>(p, plan, stream)
                            : launch_simt_kernels<kTile, false>(p, plan, stream);
}

cudaError_t launch_simt_gradients(const CrossAttentionBwdParams& p, const CrossAttentionBwdPlan& plan,
                                  cudaStream_t stream) {
  switch (plan.tile) {
    case kCrossAttentionBwdTile: return launch_simt_tile<kCrossAttentionBwdTile>(p, plan, stream);
    case kCrossAttentionBwdSmallTile: return launch_simt_tile<kCrossAttentionBwdSmallTile>(p, plan, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename scalar_t>
cudaError_t launch_all(const CrossAttentionBwdParams& p, const CrossAttentionBwdPlan& plan, bool mma,
                       cudaStream_t stream) {
  if (plan.delta_grid.x > 0) {
    const cudaError_t err = detail::launch_with_smem(detail::cross_attention_bwd_delta_kernel<scalar_t>,
                                                     plan.delta_grid, plan.delta_block, 0, stream, p);
    if (err != cudaSuccess) return err;
  }
  // Only fp32 takes the SIMT gradient kernels; not instantiating them for 16-bit types saves compile time.
  if constexpr (std::is_same_v<scalar_t, float>) {
    return launch_simt_gradients(p, plan, stream);
  } else {
    return mma ? detail::launch_cross_attention_bwd_mma(p, stream)
               : detail::launch_cross_attention_bwd_wmma<scalar_t>(p, plan, stream);
  }
}

}  // namespace

cudaError_t launch_cross_attention_bwd(const CrossAttentionBwdParams& p, cudaStream_t stream) {
  std::size_t smem_limit = 0;
  int capability = 0;
  cudaError_t err = current_smem_optin_limit(&smem_limit);
  if (err == cudaSuccess) err = current_compute_capability(&capability);
  if (err != cudaSuccess) return err;
  CrossAttentionBwdPlan plan = plan_cross_attention_bwd(p.B, p.H, p.M, p.N, p.D, p.Dv, p.dtype, smem_limit, capability,
                                                        p.kv_group);
  if (!plan.supported) return cudaErrorInvalidValue;
  plan.delta_grid.x = cross_attention_bwd_delta_grid(p, plan);
  if (p.attn_mask != nullptr && p.attn_mask_kind == AttnMaskKind::kNone) return cudaErrorInvalidValue;
  const bool has_rows = p.B * p.H * p.M > 0, has_keys = p.B * p.H * p.N > 0;
  if ((has_rows && (p.q == nullptr || p.out == nullptr || p.grad_out == nullptr || p.lse == nullptr ||
                    p.grad_lse == nullptr || p.delta == nullptr || p.grad_q == nullptr)) ||
      (has_keys && (p.k == nullptr || p.v == nullptr || p.grad_k == nullptr || p.grad_v == nullptr))) {
    return cudaErrorInvalidValue;
  }
  // fp16/bf16: the mma.sync kernels where they can load the rows (attention_bwd_mma.cu), else WMMA.
  const bool mma = plan.tensor_cores && detail::cross_attention_bwd_mma_ineligible(p, capability, smem_limit) == nullptr;
  return detail::dispatch_attention_dtype(
      p.dtype, [&](auto scalar) { return launch_all<decltype(scalar)>(p, plan, mma, stream); });
}

}  // namespace cuda
}  // namespace attn_ext
