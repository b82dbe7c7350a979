// Host-side interface of the CUDA chunked cross-attention forward kernel (docs/spec.md §1).
//
// Only CUDA runtime types appear here (no ATen/c10): the CPU-only torch wheel on the build machines
// ships no ATen/cuda headers, so the torch-facing op unpacks tensors into this struct itself. The
// header is includable from g++-compiled host code as long as the CUDA include directory is on the
// path; the kernel templates live in attention_fwd_kernel.cuh.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/attention_mask.h"
#include "common/packed_sequences.h"
#include "common/qkv_layout.h"
#include "attention_fwd_plan.h"

namespace attn_ext {
namespace cuda {

/// Arguments of the forward kernel: raw device pointers plus element strides.
///
/// Layout as docs/spec.md §0: q [B,H,M,D], k [B,H,N,D], v [B,H,N,Dv]. Batch, head and row strides are free
/// (in elements, may be 0 for broadcast or anything a view produces); the innermost (feature) stride
/// must be 1. q, k, v and out share `dtype`. The AttentionMaskLayout part (attention_fwd: causal,
/// attn_mask, GQA) stays at its defaults for cross_attention_fwd; with GQA, k and v have H / kv_group heads.
/// The PackedSequences part describes a packed (varlen) call (common/packed_sequences.h): then B counts the
/// sequences, M and N are the longest one's, and out / lse are [1, H, total_q, ·].
struct CrossAttentionFwdParams : QkvLayout, AttentionMaskLayout, PackedSequences {
  const void* q = nullptr;  ///< [B,H,M,D] of `dtype`
  const void* k = nullptr;  ///< [B,H,N,D] of `dtype`
  const void* v = nullptr;  ///< [B,H,N,Dv] of `dtype`
  /// Optional [B,N] bytes, nonzero = padding (ignored key), i.e. a torch.bool mask viewed as uint8;
  /// innermost stride 1. nullptr = every key is valid.
  const uint8_t* key_padding_mask = nullptr;
  void* out = nullptr;    ///< [B,H,M,Dv] of `dtype`, contiguous; fully written
  float* lse = nullptr;   ///< [B,H,M] fp32 contiguous, natural log; −inf for a row with no valid key

  int64_t B = 0, H = 0, M = 0, N = 0, D = 0, Dv = 0;
};

/// Enqueues the forward pass on `stream`: out = softmax(scale·q kᵀ + masks) v, and lse.
///
/// With pair masks (causal or attn_mask: p.has_pair_masks()) the kernels' pair-mask instantiations run
/// (fp32: one head-dim bucket for D and Dv, like the tensor-core kernel); a causal block stops at the
/// last key tile its rows can see, so causal self-attention does about half the work.
///
/// The kernels stream the keys in tiles of 32 with the online softmax of attn_ext/online_softmax.h,
/// so no [M, N] matrix exists and memory is O(tile) whatever N is. fp32 runs on CUDA cores (SIMT);
/// fp16 and bf16 on tensor cores (fp32 accumulation): from sm_80 on the FlashAttention-2-style kernel
/// (mma.sync, ldmatrix, cp.async; rows on 16-byte boundaries, D and Dv multiples of 8), else WMMA; D and
/// Dv zero-padded to one
/// instantiation in {32, 64, 128, 256} (so any D, Dv ≤ 256 works, multiples of 16 or not). A query row whose keys are all
/// padded (or N = 0) gets out = 0 and lse = −inf, never NaN. The tiling is the one
/// plan_cross_attention_fwd() reports for the current device's opt-in shared memory.
///
/// Returns cudaErrorInvalidValue for an unsupported shape or dtype (D or Dv outside [1, 256], grid
/// overflow, no tile that fits the device) or null pointers, and otherwise the launch's
/// cudaGetLastError(). Asynchronous: errors raised while the kernel runs surface at the next
/// synchronisation, as for any launch. B·H·M = 0 enqueues nothing and returns cudaSuccess.
cudaError_t launch_cross_attention_fwd(const CrossAttentionFwdParams& p, cudaStream_t stream);

namespace detail {
/// The fp16/bf16 half of launch_cross_attention_fwd below sm_80 or for rows the mma kernel cannot load
/// (WMMA kernel), for a validated, non-empty plan.
cudaError_t launch_cross_attention_fwd_wmma(const CrossAttentionFwdParams& p, const CrossAttentionLaunchPlan& plan,
                                            cudaStream_t stream);
/// Why the FlashAttention-2-style kernel (attention_fwd_mma.cu) cannot take this fp16/bf16 problem on a
/// device of this compute capability and opt-in shared memory, or nullptr when it can.
const char* cross_attention_fwd_mma_ineligible(const CrossAttentionFwdParams& p, int compute_capability,
                                               std::size_t smem_limit);
/// The fp16/bf16 half of launch_cross_attention_fwd from sm_80 on, for a non-empty problem it can take.
cudaError_t launch_cross_attention_fwd_mma(const CrossAttentionFwdParams& p, cudaStream_t stream);
}  // namespace detail

}  // namespace cuda
}  // namespace attn_ext
