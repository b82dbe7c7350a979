// Launcher of the chunked cross-attention forward: validates the problem, asks
// plan_cross_attention_fwd() for the geometry, and dispatches fp32 (D, Dv) to an instantiation of the
// SIMT kernel in cross_attention_fwd_kernel.cuh, fp16/bf16 to the tensor-core kernel.
#include "cross_attention_fwd.cuh"

#include "cross_attention_fwd_kernel.cuh"
#include "cross_attention_fwd_plan.h"
#include "common/launch.cuh"

namespace attn_ext {
namespace cuda {
namespace {

template <typename scalar_t, int kHeadDim, int kHeadDimV>
cudaError_t launch_instantiation(const CrossAttentionFwdParams& p, const CrossAttentionLaunchPlan& plan,
                                 cudaStream_t stream) {
  constexpr int kRowsPerWarp = cross_attention_fwd_rows_per_warp(kHeadDimV);
  constexpr int kWarps = kCrossAttentionFwdWarps;
  using Layout = detail::FwdSmemLayout<kWarps * kRowsPerWarp, kCrossAttentionFwdBlockN, kHeadDim, kHeadDimV>;
  static_assert(Layout::kFloats * sizeof(float) == cross_attention_fwd_smem_bytes(kHeadDim, kHeadDimV),
                "kernel shared-memory layout and launch plan disagree");
  static_assert(Layout::kKStride == cross_attention_fwd_k_tile_stride(kHeadDim),
                "kernel K-tile stride and launch plan disagree");
  return detail::launch_with_smem(detail::cross_attention_fwd_kernel<scalar_t, kHeadDim, kHeadDimV, kRowsPerWarp, kWarps>,
                                  plan.grid, plan.block, plan.shared_memory_bytes, stream, p);
}

template <typename scalar_t, int kHeadDim>
cudaError_t dispatch_head_dim_v(const CrossAttentionFwdParams& p, const CrossAttentionLaunchPlan& plan,
                                cudaStream_t stream) {
  switch (plan.head_dim_v_instantiation) {
    case 32: return launch_instantiation<scalar_t, kHeadDim, 32>(p, plan, stream);
    case 64: return launch_instantiation<scalar_t, kHeadDim, 64>(p, plan, stream);
    case 128: return launch_instantiation<scalar_t, kHeadDim, 128>(p, plan, stream);
    case 256: return launch_instantiation<scalar_t, kHeadDim, 256>(p, plan, stream);
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
  const CrossAttentionLaunchPlan plan = plan_cross_attention_fwd(p.B, p.H, p.M, p.N, p.D, p.Dv, p.dtype);
  if (!plan.supported) return cudaErrorInvalidValue;
  if (plan.empty) return cudaSuccess;
  // k and v are only dereferenced when N > 0; an empty key set legitimately has no storage.
  if (p.q == nullptr || p.out == nullptr || p.lse == nullptr || (p.N > 0 && (p.k == nullptr || p.v == nullptr))) {
    return cudaErrorInvalidValue;
  }
  // fp16/bf16 run on tensor cores (cross_attention_fwd_wmma.cu); only fp32 instantiates the SIMT kernel.
  if (plan.tensor_cores) return detail::launch_cross_attention_fwd_wmma(p, plan, stream);
  return p.dtype == ScalarType::kFloat32 ? dispatch_head_dim<float>(p, plan, stream) : cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace attn_ext
