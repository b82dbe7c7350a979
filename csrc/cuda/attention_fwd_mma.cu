// Launcher of the FlashAttention-2-style forward (attention_fwd_mma_kernel.cuh): one instantiation per
// (dtype, head-dim bucket, pair masks), the tiles of attention_fwd_mma_plan.h.
#include "attention_fwd.cuh"

#include "attention_fwd_mma_kernel.cuh"
#include "attention_fwd_mma_plan.h"
#include "common/launch.cuh"

namespace attn_ext {
namespace cuda {
namespace detail {
namespace {

template <typename scalar_t, int kDim, bool kPairMasks>
cudaError_t launch_mma(const CrossAttentionFwdParams& p, unsigned int grid, cudaStream_t stream) {
  using L = MmaFwdLayout<kDim>;
  static_assert(L::kBytes == mma_fwd_smem_bytes(kDim), "kernel shared-memory layout and launch plan disagree");
  static_assert(mma_fwd_smem_bytes(kDim) <= kSmemSm80Bytes, "every bucket's tile fits sm_80");
  return launch_with_smem(attention_fwd_mma_kernel<scalar_t, kDim, kPairMasks>, LaunchDims{grid, 1, 1},
                          LaunchDims{static_cast<unsigned int>(L::kThreads), 1, 1}, L::kBytes, stream, p);
}

}  // namespace

const char* cross_attention_fwd_mma_ineligible(const CrossAttentionFwdParams& p, int compute_capability,
                                               std::size_t smem_limit) {
  const char* why = mma_qkv_ineligible(compute_capability, p.D, p.Dv, p.q, p.k, p.v, p);
  if (why != nullptr) return why;
  const int dim = cross_attention_fwd_head_dim_instantiation(p.D > p.Dv ? p.D : p.Dv);
  if (dim == 0) return "head dimension D and Dv must be in [1, 256] for the CUDA kernel";
  if (mma_fwd_smem_bytes(dim) > smem_limit) return "the device's shared memory per block is below the tile's";
  return nullptr;
}

cudaError_t launch_cross_attention_fwd_mma(const CrossAttentionFwdParams& p, cudaStream_t stream) {
  const int dim = cross_attention_fwd_head_dim_instantiation(p.D > p.Dv ? p.D : p.Dv);
  const int64_t block_m = mma_fwd_tile(dim).block_m();
  const int64_t m_tiles = (p.M + block_m - 1) / block_m;
  if (p.H > kMaxGridX / p.B || m_tiles > kMaxGridX / (p.B * p.H)) return cudaErrorInvalidValue;
  const auto grid = static_cast<unsigned int>(p.B * p.H * m_tiles);
  return dispatch_tensor_core(p.dtype, dim, [&](auto scalar, auto bucket) {
    constexpr int kDim = decltype(bucket)::value;
    using scalar_t = decltype(scalar);
    return p.has_pair_masks() ? launch_mma<scalar_t, kDim, true>(p, grid, stream)
                              : launch_mma<scalar_t, kDim, false>(p, grid, stream);
  });
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
