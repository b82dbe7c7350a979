// The sequence of kernel launches of the CUDA Intention forward and backward, planned by plain C++.
//
// Each op is a short chain of generic kernels (strided batched GEMM, batched Cholesky, solve, a
// reduction). Planning the chain here, as data, lets intention.cu launch it with nvcc and lets the
// host emulation test (csrc/tests/cuda_intention_emulation_test.cpp) run the very same chain
// through the emulator: the operand strides, which are where such code goes wrong, are tested.
#pragma once

#include <cstdint>

#include "batched_cholesky.cuh"
#include "intention.cuh"
#include "small_gemm.h"

namespace attn_ext {
namespace cuda {

/// out[m] = −Σ_i a[m, i]·b[m, i] over `size` entries per item (the backward's dα = −Σ dB ⊙ W).
struct NegatedDotParams {
  const float* a = nullptr;
  const float* b = nullptr;
  float* out = nullptr;
  int64_t batch = 0, size = 0;
};
constexpr int kNegatedDotThreads = 128;

/// One launch. The GEMM kinds name the instantiation by operand types: S = the op's dtype, F = fp32.
struct IntentionStep {
  enum Kind { kGemmSSF, kGemmSFS, kGemmFFF, kCholesky, kSolve, kNegatedDot } kind = kGemmFFF;
  SmallGemmParams gemm;
  BatchedCholeskyParams cholesky;
  BatchedCholeskySolveParams solve;
  NegatedDotParams dot;
};

struct IntentionPlan {
  bool supported = false;
  const char* error = nullptr;
  SmemShortfall smem;  ///< set when a step's kernel does not fit the device's shared memory
  int count = 0;
  IntentionStep steps[8];
};

namespace detail {

inline GemmOperand operand(const void* data, int64_t sb, int64_t sh, int64_t srow, int64_t scol) {
  GemmOperand o;
  o.data = data, o.stride_b = sb, o.stride_h = sh, o.stride_row = srow, o.stride_col = scol;
  return o;
}

inline SmallGemmParams gemm(GemmOperand a, GemmOperand b, void* c, int64_t cb, int64_t ch, int64_t crow, int64_t B,
                            int64_t H, int64_t rows, int64_t cols, int64_t inner, float alpha) {
  SmallGemmParams g;
  g.a = a, g.b = b, g.c = c, g.c_stride_b = cb, g.c_stride_h = ch, g.c_stride_row = crow;
  g.batch = B, g.heads = H, g.rows = rows, g.cols = cols, g.inner = inner, g.alpha = alpha;
  return g;
}

inline const char* intention_size_error(const IntentionInputs& x) {
  if (x.B < 0 || x.H < 0 || x.M < 0 || x.N < 0 || x.D < 0 || x.Dv < 0) return "negative size";
  if (x.D > kCholeskyMaxDim) return "the CUDA Intention kernels support head dim D <= 128 (one factor per block)";
  if (!x.has_values && x.Dv != x.D) return "without v, Dv must equal D (C = I)";
  return nullptr;
}

/// Checks every step's launch geometry on a device with `smem_limit` bytes of shared memory per block
/// (the launcher validates the whole chain before enqueuing its first kernel): `plan` stays supported,
/// or takes the first failing step's error.
inline void check_steps(IntentionPlan& plan, std::size_t smem_limit) {
  for (int i = 0; i < plan.count; ++i) {
    const IntentionStep& st = plan.steps[i];
    const char* error = nullptr;
    SmemShortfall smem;
    switch (st.kind) {
      case IntentionStep::kGemmSSF:
      case IntentionStep::kGemmSFS:
      case IntentionStep::kGemmFFF: {
        const SmallGemmLaunchPlan g =
            plan_small_gemm(st.gemm.batch * st.gemm.heads, st.gemm.rows, st.gemm.cols, smem_limit);
        error = g.error, smem = g.smem;
        break;
      }
      case IntentionStep::kCholesky: {
        const CholeskyLaunchPlan c =
            plan_batched_cholesky(st.cholesky.batch, st.cholesky.n, -1, st.cholesky.dtype, smem_limit);
        error = c.error, smem = c.smem;
        break;
      }
      case IntentionStep::kSolve: {
        const CholeskyLaunchPlan c =
            plan_batched_cholesky(st.solve.batch, st.solve.n, st.solve.r, st.solve.dtype, smem_limit);
        error = c.error, smem = c.smem;
        break;
      }
      case IntentionStep::kNegatedDot:
        if (st.dot.batch > kMaxGridX) error = "too many heads for the CUDA grid";
        break;
    }
    if (error != nullptr) {
      plan.supported = false, plan.error = error, plan.smem = smem;
      return;
    }
  }
}

}  // namespace detail

/// The forward chain: G = KᵀK (masked), C = KᵀV (masked), L = chol(G + αI), W = L⁻ᵀL⁻¹C, out = scale·Q W,
/// for a device with `smem_limit` bytes of opt-in shared memory per block.
inline IntentionPlan plan_intention_fwd(const IntentionFwdParams& p, std::size_t smem_limit) {
  using detail::gemm;
  using detail::operand;
  const IntentionInputs& x = p.in;
  IntentionPlan plan;
  plan.error = detail::intention_size_error(x);
  if (plan.error != nullptr) return plan;
  const int64_t B = x.B, H = x.H, D = x.D, Dv = x.Dv, E = D + (x.has_values ? Dv : 0);
  const GemmOperand k_t = operand(x.k, x.k_stride_b, x.k_stride_h, 1, x.k_stride_n);  // Kᵀ [D, N]
  IntentionStep* s = plan.steps;

  s->kind = IntentionStep::kGemmSSF;  // G = KᵀK into stats[:, :D]
  s->gemm = gemm(k_t, operand(x.k, x.k_stride_b, x.k_stride_h, x.k_stride_n, 1), p.stats, H * D * E, D * E, E, B, H,
                 D, D, x.N, 1.0f);
  s->gemm.inner_mask = x.key_padding_mask, s->gemm.inner_mask_stride_b = x.mask_stride_b;
  ++s;
  if (x.has_values) {  // C = KᵀV into stats[:, D:]
    s->kind = IntentionStep::kGemmSSF;
    s->gemm = gemm(k_t, operand(x.v, x.v_stride_b, x.v_stride_h, x.v_stride_n, 1), p.stats + D, H * D * E, D * E, E,
                   B, H, D, Dv, x.N, 1.0f);
    s->gemm.inner_mask = x.key_padding_mask, s->gemm.inner_mask_stride_b = x.mask_stride_b;
    ++s;
  }
  s->kind = IntentionStep::kCholesky;
  s->cholesky.a.data = p.stats, s->cholesky.a.stride_batch = D * E, s->cholesky.a.stride_row = E;
  s->cholesky.a.stride_col = 1;
  s->cholesky.diag_shift = p.alpha, s->cholesky.l = p.factor, s->cholesky.info = p.info;
  s->cholesky.batch = B * H, s->cholesky.n = D;
  ++s;
  s->kind = IntentionStep::kSolve;  // W = A⁻¹C, C = I without v
  s->solve.l.data = p.factor, s->solve.l.stride_batch = D * D, s->solve.l.stride_row = D, s->solve.l.stride_col = 1;
  if (x.has_values) {
    s->solve.b.data = p.stats + D, s->solve.b.stride_batch = D * E, s->solve.b.stride_row = E;
    s->solve.b.stride_col = 1;
  }
  s->solve.x = p.weights, s->solve.batch = B * H, s->solve.n = D, s->solve.r = Dv;
  ++s;
  s->kind = IntentionStep::kGemmSFS;  // out = scale·Q W
  s->gemm = gemm(operand(x.q, x.q_stride_b, x.q_stride_h, x.q_stride_m, 1),
                 operand(p.weights, H * D * Dv, D * Dv, Dv, 1), p.out, H * x.M * Dv, x.M * Dv, Dv, B, H, x.M, Dv, D,
                 x.scale);
  ++s;
  plan.count = static_cast<int>(s - plan.steps);
  plan.supported = true;
  detail::check_steps(plan, smem_limit);
  return plan;
}

/// The backward chain; see intention.cuh.
inline IntentionPlan plan_intention_bwd(const IntentionBwdParams& p, std::size_t smem_limit) {
  using detail::gemm;
  using detail::operand;
  const IntentionInputs& x = p.in;
  IntentionPlan plan;
  plan.error = detail::intention_size_error(x);
  if (plan.error != nullptr) return plan;
  const int64_t B = x.B, H = x.H, M = x.M, N = x.N, D = x.D, Dv = x.Dv;
  const GemmOperand dy = operand(p.grad_out, H * M * Dv, M * Dv, Dv, 1);
  const GemmOperand w = operand(p.weights, H * D * Dv, D * Dv, Dv, 1);
  const GemmOperand w_t = operand(p.weights, H * D * Dv, D * Dv, 1, Dv);
  const GemmOperand db = operand(p.db, H * D * Dv, D * Dv, Dv, 1);
  const GemmOperand db_t = operand(p.db, H * D * Dv, D * Dv, 1, Dv);
  const GemmOperand k = operand(x.k, x.k_stride_b, x.k_stride_h, x.k_stride_n, 1);
  IntentionStep* s = plan.steps;

  s->kind = IntentionStep::kGemmSFS;  // dQ = scale·dY Wᵀ
  s->gemm = gemm(dy, w_t, p.grad_q, H * M * D, M * D, D, B, H, M, D, Dv, x.scale);
  ++s;
  s->kind = IntentionStep::kGemmSSF;  // dB ← scale·Qᵀ dY
  s->gemm = gemm(operand(x.q, x.q_stride_b, x.q_stride_h, 1, x.q_stride_m), dy, p.db, H * D * Dv, D * Dv, Dv, B, H, D,
                 Dv, M, x.scale);
  ++s;
  s->kind = IntentionStep::kSolve;  // dB = A⁻¹(scale·Qᵀ dY), in place
  s->solve.l.data = p.factor, s->solve.l.stride_batch = D * D, s->solve.l.stride_row = D, s->solve.l.stride_col = 1;
  s->solve.b.data = p.db, s->solve.b.stride_batch = D * Dv, s->solve.b.stride_row = Dv, s->solve.b.stride_col = 1;
  s->solve.x = p.db, s->solve.batch = B * H, s->solve.n = D, s->solve.r = Dv;
  ++s;
  s->kind = IntentionStep::kNegatedDot;  // dα = −Σ dB ⊙ W
  s->dot.a = p.db, s->dot.b = p.weights, s->dot.out = p.grad_alpha, s->dot.batch = B * H, s->dot.size = D * Dv;
  ++s;
  s->kind = IntentionStep::kGemmFFF;  // E = dB Wᵀ + W dBᵀ
  s->gemm = gemm(db, w_t, p.e, H * D * D, D * D, D, B, H, D, D, Dv, 1.0f);
  s->gemm.a2 = w, s->gemm.b2 = db_t, s->gemm.inner2 = Dv, s->gemm.alpha2 = 1.0f;
  ++s;
  s->kind = IntentionStep::kGemmSFS;  // dK = −K E + V dBᵀ, padding rows 0
  s->gemm = gemm(k, operand(p.e, H * D * D, D * D, D, 1), p.grad_k, H * N * D, N * D, D, B, H, N, D, D, -1.0f);
  if (x.has_values) {
    s->gemm.a2 = operand(x.v, x.v_stride_b, x.v_stride_h, x.v_stride_n, 1), s->gemm.b2 = db_t;
    s->gemm.inner2 = Dv, s->gemm.alpha2 = 1.0f;
  }
  s->gemm.row_mask = x.key_padding_mask, s->gemm.row_mask_stride_b = x.mask_stride_b;
  ++s;
  if (x.has_values) {
    s->kind = IntentionStep::kGemmSFS;  // dV = K dB, padding rows 0
    s->gemm = gemm(k, db, p.grad_v, H * N * Dv, N * Dv, Dv, B, H, N, Dv, D, 1.0f);
    s->gemm.row_mask = x.key_padding_mask, s->gemm.row_mask_stride_b = x.mask_stride_b;
    ++s;
  }
  plan.count = static_cast<int>(s - plan.steps);
  plan.supported = true;
  detail::check_steps(plan, smem_limit);
  return plan;
}

}  // namespace cuda
}  // namespace attn_ext
