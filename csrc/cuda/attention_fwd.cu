// Launcher of the chunked cross-attention forward: validates the problem, asks
// plan_cross_attention_fwd() for the geometry on the current device, and dispatches fp32 (D, Dv, rows
// per warp) to an instantiation of the SIMT kernel in attention_fwd_kernel.cuh, fp16/bf16 to
// the tensor-core kernel.
#include "attention_fwd.cuh"

#include "attention_fwd_kernel.cuh"
#include "attention_fwd_plan.h"
#include "common/device_limits.h"
#include "common/launch.cuh"

namespace attn_ext {
namespace cuda {
namespace {

template <typename scalar_t, int kHeadDim, int kHeadDimV, int kRowsPerWarp, bool kPairMasks>
cudaError_t launch_instantiation(const CrossAttentionFwdParams& p, const CrossAttentionLaunchPlan& plan,
                                 cudaStream_t stream) {
  constexpr int kWarps = kCrossAttentionFwdWarps;
  using Layout = detail::FwdSmemLayout<kWarps * kRowsPerWarp, kCrossAttentionFwdBlockN, kHeadDim, kHeadDimV>;
  static_assert(Layout::kFloats * sizeof(float) == cross_attention_fwd_smem_bytes(kHeadDim, kHeadDimV, kRowsPerWarp),
                "kernel shared-memory layout and launch plan disagree");
  static_assert(Layout::kKStride == cross_attention_fwd_k_tile_stride(kHeadDim),
                "kernel K-tile stride and launch plan disagree");
  static_assert(kRowsPerWarp != cross_attention_fwd_rows_per_warp(kHeadDimV) ||
                    cross_attention_fwd_smem_bytes(kHeadDim, kHeadDimV, kRowsPerWarp) <= kSmemSm80Bytes,
                "the preferred tile fits sm_80");
  return detail::launch_with_smem(
      detail::cross_attention_fwd_kernel<scalar_t, kHeadDim, kHeadDimV, kRowsPerWarp, kWarps, kPairMasks>, plan.grid,
      plan.block, plan.shared_memory_bytes, stream, p);
}

/// The plan's rows per warp, among those compiled for (D, Dv) (cross_attention_fwd_rows_compiled).
template <typename scalar_t, int kHeadDim, int kHeadDimV, bool kPairMasks = false>
cudaError_t launch_rows(const CrossAttentionFwdParams& p, const CrossAttentionLaunchPlan& plan, cudaStream_t stream) {
  return detail::dispatch_tile(
      plan.rows_per_warp, [](int rows) { return cross_attention_fwd_rows_compiled(kHeadDim, kHeadDimV, rows); },
      [&](auto rows) {
        return launch_instantiation<scalar_t, kHeadDim, kHeadDimV, decltype(rows)::value, kPairMasks>(p, plan, stream);
      });
}

/// The pair-mask instantiations (attention_fwd with causal or attn_mask): one bucket for D and Dv,
/// as plan_cross_attention_fwd(..., pair_masks = true) plans them.
cudaError_t launch_pair_masks(const CrossAttentionFwdParams& p, const CrossAttentionLaunchPlan& plan,
                              cudaStream_t stream) {
  if (plan.head_dim_instantiation != plan.head_dim_v_instantiation) return cudaErrorInvalidValue;
  return detail::dispatch_head_dim_bucket(plan.head_dim_instantiation, [&](auto bucket) {
    constexpr int kDim = decltype(bucket)::value;
    return launch_rows<float, kDim, kDim, true>(p, plan, stream);
  });
}

template <typename scalar_t, int kHeadDim>
cudaError_t dispatch_head_dim_v(const CrossAttentionFwdParams& p, const CrossAttentionLaunchPlan& plan,
                                cudaStream_t stream) {
  switch (plan.head_dim_v_instantiation) {
    case 32: return launch_rows<scalar_t, kHeadDim, 32>(p, plan, stream);
    case 64: return launch_rows<scalar_t, kHeadDim, 64>(p, plan, stream);
    case 128: return launch_rows<scalar_t, kHeadDim, 128>(p, plan, stream);
    case 256: return launch_rows<scalar_t, kHeadDim, 256>(p, plan, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename scalar_t>
cudaError_t dispatch_head_dim(const CrossAttentionFwdParams& p, const CrossAttentionLaunchPlan& plan,
                              cudaStream_t stream) {
  switch (plan.head_dim_instantiation) {
    case 32: return dispatch_head_dim_v<scalar_t, 32>(p, plan, stream);
    case 64: return dispatch_head_dim_v<scalar_t, 64>(p, plan, stream);
    case 128: return dispatch_head_dim_v<scalar_t, 128>(p, plan, stream);
    case 256: return dispatch_head_dim_v<scalar_t, 256>(p, plan, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_cross_attention_fwd(const CrossAttentionFwdParams& p, cudaStream_t stream) {
  std::size_t smem_limit = 0;
  int capability = 0;
  cudaError_t err = current_smem_optin_limit(&smem_limit);
  if (err == cudaSuccess) err = current_compute_capability(&capability);
  if (err != cudaSuccess) return err;
  const bool pair_masks = p.has_pair_masks();
  const CrossAttentionLaunchPlan plan = plan_cross_attention_fwd(p.B, p.H, p.M, p.N, p.D, p.Dv, p.dtype, smem_limit,
                                                                 capability, pair_masks);
  if (!plan.supported) return cudaErrorInvalidValue;
  if (plan.empty) return cudaSuccess;
  // k and v are only dereferenced when N > 0; an empty key set legitimately has no storage.
  if (p.q == nullptr || p.out == nullptr || p.lse == nullptr || (p.N > 0 && (p.k == nullptr || p.v == nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (p.kv_group < 1 || p.H % p.kv_group != 0) return cudaErrorInvalidValue;
  if (p.attn_mask != nullptr && p.attn_mask_kind == AttnMaskKind::kNone) return cudaErrorInvalidValue;
  // fp16/bf16 run on tensor cores: the mma.sync kernel where it can load the rows (attention_fwd_mma.cu),
  // else WMMA (attention_fwd_wmma.cu); only fp32 instantiates the SIMT kernel.
  if (plan.tensor_cores) {
    if (detail::cross_attention_fwd_mma_ineligible(p, capability, smem_limit) == nullptr) {
      return detail::launch_cross_attention_fwd_mma(p, stream);
    }
    return detail::launch_cross_attention_fwd_wmma(p, plan, stream);
  }
  if (p.dtype != ScalarType::kFloat32) return cudaErrorInvalidValue;
  return pair_masks ? launch_pair_masks(p, plan, stream) : dispatch_head_dim<float>(p, plan, stream);
}

}  // namespace cuda
}  // namespace attn_ext
