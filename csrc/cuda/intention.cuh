// Host-side interface of the CUDA Intention forward and backward (docs/spec.md §4, primal form), mirroring
// csrc/cpu/intention.cpp: out = scale·Q (KᵀK + αI)⁻¹ KᵀV, or with v = nullptr (C = I) σIntention's
// transformed queries scale·Q (KᵀK + αI)⁻¹. Only CUDA runtime types, no ATen/c10.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/launch_geometry.h"
#include "common/qkv_layout.h"

namespace attn_ext {
namespace cuda {

/// The inputs shared by the forward and the backward. q [B,H,M,D], k [B,H,N,D], v [B,H,N,Dv] with
/// free batch/head/row strides (innermost 1), all of `dtype`.
struct IntentionInputs : QkvLayout {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;                    ///< read only when has_values
  bool has_values = false;                    ///< false: C = I (then Dv must equal D). Not `v != nullptr`:
                                              ///< an empty v (N = 0) has a null pointer too.
  const uint8_t* key_padding_mask = nullptr;  ///< [B,N] bytes, nonzero = padding; nullptr = none
  int64_t B = 0, H = 0, M = 0, N = 0, D = 0, Dv = 0;
};

/// Forward arguments. Outputs and workspace are contiguous fp32 unless said otherwise.
struct IntentionFwdParams {
  IntentionInputs in;
  const float* alpha = nullptr;  ///< [B,H]
  void* out = nullptr;           ///< [B,H,M,Dv] of `dtype`
  float* factor = nullptr;       ///< [B,H,D,D]: L, zeros above the diagonal
  float* weights = nullptr;      ///< [B,H,D,Dv]: W = (KᵀK + αI)⁻¹ C
  float* stats = nullptr;        ///< workspace [B,H,D,E], E = D + Dv (D without v)
  int32_t* info = nullptr;       ///< [B,H] Cholesky info; nonzero = A not positive definite
};

/// Backward arguments: the forward's inputs, its saved factor and weights, grad_out [B,H,M,Dv]
/// (contiguous, `dtype`). Gradients are contiguous; rows of padding keys get 0.
struct IntentionBwdParams {
  IntentionInputs in;
  const void* grad_out = nullptr;
  const float* factor = nullptr;   ///< [B,H,D,D]
  const float* weights = nullptr;  ///< [B,H,D,Dv]
  void* grad_q = nullptr;          ///< [B,H,M,D]
  void* grad_k = nullptr;          ///< [B,H,N,D]
  void* grad_v = nullptr;          ///< [B,H,N,Dv]; unused without v
  float* grad_alpha = nullptr;     ///< [B,H]
  float* db = nullptr;             ///< workspace [B,H,D,Dv]: dB = A⁻¹(scale·Qᵀ dY)
  float* e = nullptr;              ///< workspace [B,H,D,D]: dB Wᵀ + W dBᵀ
};

/// Enqueues the forward (Gram statistics, factor, solve, output; see intention_plan.h). The caller
/// must check `info` (a device array) before trusting the outputs: a nonzero entry means A was not
/// positive definite (α = 0 with too few or collinear keys). cudaErrorInvalidValue for D > 128 or
/// Dv > 128·65535, a step that does not fit the current device's shared memory, null pointers;
/// otherwise the first launch error.
cudaError_t launch_intention_fwd(const IntentionFwdParams& p, cudaStream_t stream);

/// Enqueues the backward: dQ = scale·dY Wᵀ, dB = A⁻¹(scale·Qᵀ dY), dα = −Σ dB ⊙ W,
/// dK = −K(dB Wᵀ + W dBᵀ) + V dBᵀ, dV = K dB.
cudaError_t launch_intention_bwd(const IntentionBwdParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace attn_ext
