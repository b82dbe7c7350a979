// Launcher of the FlashAttention-2-style backward kernels (attention_bwd_mma_kernel.cuh): dK/dV and dQ per
// (dtype, head-dim bucket 32 / 64 / 128, pair masks), after the Δ pre-pass that attention_bwd.cu runs.
#include "attention_bwd.cuh"

#include "attention_bwd_mma_kernel.cuh"
#include "attention_bwd_mma_plan.h"
#include "attention_fwd_mma_plan.h"
#include "common/launch.cuh"

namespace attn_ext {
namespace cuda {
namespace detail {
namespace {

template <typename scalar_t, int kDim, bool kPairMasks>
cudaError_t launch_mma_bwd(const CrossAttentionBwdParams& p, cudaStream_t stream) {
  using L = MmaBwdLayout<kDim>;
  static_assert(L::kBytes == mma_bwd_smem_bytes(kDim), "kernel shared-memory layout and launch plan disagree");
  static_assert(mma_bwd_smem_bytes(kDim) <= kSmemSm80Bytes, "every bucket's tile fits sm_80");
  const LaunchDims block{static_cast<unsigned int>(L::kThreads), 1, 1};
  const int64_t key_tiles = (p.N + L::kOwn - 1) / L::kOwn, query_tiles = (p.M + L::kOwn - 1) / L::kOwn;
  const auto dkdv_blocks = static_cast<unsigned int>(p.B * (p.H / p.kv_group) * key_tiles);
  const auto dq_blocks = static_cast<unsigned int>(p.B * p.H * query_tiles);
  if (dkdv_blocks > 0) {
    const cudaError_t err = launch_with_smem(attention_bwd_mma_kernel<scalar_t, kDim, true, kPairMasks>,
                                             LaunchDims{dkdv_blocks, 1, 1}, block, L::kBytes, stream, p);
    if (err != cudaSuccess) return err;
  }
  if (dq_blocks == 0) return cudaSuccess;
  return launch_with_smem(attention_bwd_mma_kernel<scalar_t, kDim, false, kPairMasks>, LaunchDims{dq_blocks, 1, 1},
                          block, L::kBytes, stream, p);
}

}  // namespace

const char* cross_attention_bwd_mma_ineligible(const CrossAttentionBwdParams& p, int compute_capability,
                                               std::size_t smem_limit) {
  if (p.dtype == ScalarType::kFloat32) return "fp32 runs on CUDA cores";
  const int dim = cross_attention_fwd_head_dim_instantiation(p.D > p.Dv ? p.D : p.Dv);
  if (dim == 0 || dim > kMmaBwdMaxDim) return "head dims above 128 keep their accumulators in shared memory (WMMA)";
  const char* why = mma_qkv_ineligible(compute_capability, p.D, p.Dv, p.q, p.k, p.v, p,
                                       {p.dout_stride_b, p.dout_stride_h, p.dout_stride_m});
  if (why != nullptr) return why;
  if (reinterpret_cast<std::uintptr_t>(p.grad_out) % 16 != 0) return "grad_out must start on a 16-byte boundary";
  if (mma_bwd_smem_bytes(dim) > smem_limit) return "the device's shared memory per block is below the tile's";
  const int64_t tiles = (p.N > p.M ? p.N : p.M) / kMmaBwdOwnRows + 1;
  if (p.H > kMaxGridX / (p.B > 0 ? p.B : 1) || tiles > kMaxGridX / (p.B * p.H > 0 ? p.B * p.H : 1)) {
    return "too many blocks for the CUDA grid";
  }
  return nullptr;
}

cudaError_t launch_cross_attention_bwd_mma(const CrossAttentionBwdParams& p, cudaStream_t stream) {
  const int dim = cross_attention_fwd_head_dim_instantiation(p.D > p.Dv ? p.D : p.Dv);
  return dispatch_tensor_core(p.dtype, dim, [&](auto scalar, auto bucket) -> cudaError_t {
    constexpr int kDim = decltype(bucket)::value;
    using scalar_t = decltype(scalar);
    if constexpr (kDim > kMmaBwdMaxDim) {
      return cudaErrorInvalidValue;  // refused by cross_attention_bwd_mma_ineligible
    } else {
      return p.has_pair_masks() ? launch_mma_bwd<scalar_t, kDim, true>(p, stream)
                                : launch_mma_bwd<scalar_t, kDim, false>(p, stream);
    }
  });
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
