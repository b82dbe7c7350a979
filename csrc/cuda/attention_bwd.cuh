// Host-side interface of the CUDA chunked cross-attention backward (docs/spec.md §1 backward). Only CUDA
// runtime types, like attention_fwd.cuh; the geometry is in attention_bwd_plan.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/attention_mask.h"
#include "common/packed_sequences.h"
#include "common/qkv_layout.h"
#include "attention_bwd_plan.h"

namespace attn_ext {
namespace cuda {

/// Raw pointers and element strides (innermost stride 1) of one backward call. q, k, v, out,
/// grad_out and the gradients share `dtype`; lse, grad_lse and the workspace are fp32. The
/// AttentionMaskLayout part as in the forward; with GQA, k, v, grad_k and grad_v have H / kv_group
/// heads (dK/dV sum over each group's query heads, in one block: no atomics). A packed call (PackedSequences)
/// as in the forward: lse, grad_lse, Δ and the gradients are laid out over the packed rows.
struct CrossAttentionBwdParams : QkvLayout, AttentionMaskLayout, PackedSequences {
  const void* q = nullptr;         ///< [B,H,M,D]
  const void* k = nullptr;         ///< [B,H,N,D]
  const void* v = nullptr;         ///< [B,H,N,Dv]
  const uint8_t* key_padding_mask = nullptr;  ///< [B,N] bytes, nonzero = padding; nullptr = none
  const void* out = nullptr;       ///< [B,H,M,Dv], the forward's output
  const void* grad_out = nullptr;  ///< [B,H,M,Dv]
  const float* lse = nullptr;      ///< [B,H,M] contiguous, the forward's (−inf for empty rows)
  const float* grad_lse = nullptr; ///< [B,H,M] contiguous
  float* delta = nullptr;          ///< [B,H,M] contiguous workspace: Δ = rowsum(dO ∘ O)
  void* grad_q = nullptr;          ///< [B,H,M,D] contiguous, fully written
  void* grad_k = nullptr;          ///< [B,H,N,D] contiguous, fully written
  void* grad_v = nullptr;          ///< [B,H,N,Dv] contiguous, fully written

  int64_t B = 0, H = 0, M = 0, N = 0, D = 0, Dv = 0;
  int64_t out_stride_b = 0, out_stride_h = 0, out_stride_m = 0;
  int64_t dout_stride_b = 0, dout_stride_h = 0, dout_stride_m = 0;
};

/// The Δ pre-pass's blocks: the plan's, or a packed call's packed rows (the gradient kernels' grids count the
/// longest sequence's tiles).
inline unsigned int cross_attention_bwd_delta_grid(const CrossAttentionBwdParams& p, const CrossAttentionBwdPlan& plan) {
  return p.packed() ? cross_attention_bwd_delta_blocks(p.H * p.total_q) : plan.delta_grid.x;
}

/// Enqueues the Δ pre-pass, the dK/dV kernel and the dQ kernel on `stream` (see the plan header;
/// fp16/bf16 take the tensor-core kernels, with D and Dv zero-padded to one head-dim bucket: from sm_80
/// on the mma.sync kernels of attention_bwd_mma_plan.h where they can load the rows, else WMMA).
/// Rows with lse = −inf (no valid key) get zero gradients. The tiles are those the plan picks for the
/// current device's shared memory. Returns cudaErrorInvalidValue for an unsupported shape or dtype,
/// no tile that fits the device, or missing pointers, else the first launch error.
cudaError_t launch_cross_attention_bwd(const CrossAttentionBwdParams& p, cudaStream_t stream);

namespace detail {
/// The dK/dV and dQ kernels (WMMA) of a validated tensor-core plan of dtype scalar_t (__half or
/// __nv_bfloat16); Δ must be computed. Defined in attention_bwd_wmma_launch.cuh, instantiated
/// once per dtype by cross_attention_bwd_wmma_{fp16,bf16}.cu.
template <typename scalar_t>
cudaError_t launch_cross_attention_bwd_wmma(const CrossAttentionBwdParams& p, const CrossAttentionBwdPlan& plan,
                                            cudaStream_t stream);
/// Why the FlashAttention-2-style dK/dV and dQ kernels (attention_bwd_mma.cu) cannot take this call on a
/// device of this compute capability and opt-in shared memory, or nullptr when they can.
const char* cross_attention_bwd_mma_ineligible(const CrossAttentionBwdParams& p, int compute_capability,
                                               std::size_t smem_limit);
/// Those kernels, for a call they can take; Δ must be computed.
cudaError_t launch_cross_attention_bwd_mma(const CrossAttentionBwdParams& p, cudaStream_t stream);
}  // namespace detail

}  // namespace cuda
}  // namespace attn_ext
