// Launchers of the CUDA Intention forward and backward: run the chain that intention_plan.h plans,
// dispatching each GEMM step to its (operand types) instantiation. Five GEMM instantiations in all:
// <S, S, f32> and <S, f32, S> per dtype S (coinciding for fp32) and <f32, f32, f32>.
#include "intention.cuh"

#include "batched_cholesky.cuh"
#include "common/launch.cuh"
#include "intention_kernel.cuh"
#include "intention_plan.h"
#include "small_gemm_kernel.cuh"

namespace attn_ext {
namespace cuda {
namespace {

template <typename TA, typename TB, typename TC>
cudaError_t launch_gemm(const SmallGemmParams& g, cudaStream_t stream) {
  const SmallGemmLaunchPlan plan = plan_small_gemm(g.batch * g.heads, g.rows, g.cols);
  if (!plan.supported) return cudaErrorInvalidValue;
  if (plan.empty) return cudaSuccess;
  detail::small_gemm_kernel<TA, TB, TC>
      <<<dim3(plan.grid.x, plan.grid.y), dim3(plan.block.x), plan.shared_memory_bytes, stream>>>(g);
  return cudaGetLastError();
}

template <typename S>
cudaError_t run_step(const IntentionStep& st, cudaStream_t stream) {
  switch (st.kind) {
    case IntentionStep::kGemmSSF: return launch_gemm<S, S, float>(st.gemm, stream);
    case IntentionStep::kGemmSFS: return launch_gemm<S, float, S>(st.gemm, stream);
    case IntentionStep::kGemmFFF: return launch_gemm<float, float, float>(st.gemm, stream);
    case IntentionStep::kCholesky: return launch_batched_cholesky(st.cholesky, stream);
    case IntentionStep::kSolve: return launch_batched_cholesky_solve(st.solve, stream);
    case IntentionStep::kNegatedDot:
      if (st.dot.batch == 0) return cudaSuccess;
      detail::negated_dot_kernel<<<dim3(static_cast<unsigned int>(st.dot.batch)), dim3(kNegatedDotThreads),
                                   detail::kNegatedDotSmemBytes, stream>>>(st.dot);
      return cudaGetLastError();
  }
  return cudaErrorInvalidValue;
}

/// Validates every step's geometry before launching the first, so that a rejected shape enqueues nothing.
bool plan_launchable(const IntentionPlan& plan) {
  if (!plan.supported) return false;
  for (int i = 0; i < plan.count; ++i) {
    const IntentionStep& st = plan.steps[i];
    switch (st.kind) {
      case IntentionStep::kGemmSSF:
      case IntentionStep::kGemmSFS:
      case IntentionStep::kGemmFFF:
        if (!plan_small_gemm(st.gemm.batch * st.gemm.heads, st.gemm.rows, st.gemm.cols).supported) return false;
        break;
      case IntentionStep::kCholesky:
        if (!plan_batched_cholesky(st.cholesky.batch, st.cholesky.n, -1, st.cholesky.dtype).supported) return false;
        break;
      case IntentionStep::kSolve:
        if (!plan_batched_cholesky(st.solve.batch, st.solve.n, st.solve.r, st.solve.dtype).supported) return false;
        break;
      case IntentionStep::kNegatedDot:
        if (st.dot.batch > kMaxGridX) return false;
        break;
    }
  }
  return true;
}

template <typename S>
cudaError_t run_plan(const IntentionPlan& plan, cudaStream_t stream) {
  for (int i = 0; i < plan.count; ++i) {
    const cudaError_t err = run_step<S>(plan.steps[i], stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t run(const IntentionPlan& plan, ScalarType dtype, cudaStream_t stream) {
  if (!plan_launchable(plan)) return cudaErrorInvalidValue;
  return detail::dispatch_attention_dtype(dtype, [&](auto scalar) { return run_plan<decltype(scalar)>(plan, stream); });
}

}  // namespace

cudaError_t launch_intention_fwd(const IntentionFwdParams& p, cudaStream_t stream) {
  if (p.in.B * p.in.H == 0) return cudaSuccess;
  if (p.in.q == nullptr || p.in.k == nullptr || p.alpha == nullptr || p.out == nullptr || p.factor == nullptr ||
      p.weights == nullptr || p.stats == nullptr || p.info == nullptr) {
    return cudaErrorInvalidValue;
  }
  return run(plan_intention_fwd(p), p.in.dtype, stream);
}

cudaError_t launch_intention_bwd(const IntentionBwdParams& p, cudaStream_t stream) {
  if (p.in.B * p.in.H == 0) return cudaSuccess;
  if (p.grad_out == nullptr || p.in.q == nullptr || p.in.k == nullptr || p.factor == nullptr || p.weights == nullptr ||
      p.grad_q == nullptr || p.grad_k == nullptr || (p.in.v != nullptr && p.grad_v == nullptr) ||
      p.grad_alpha == nullptr || p.db == nullptr || p.e == nullptr) {
    return cudaErrorInvalidValue;
  }
  return run(plan_intention_bwd(p), p.in.dtype, stream);
}

}  // namespace cuda
}  // namespace attn_ext
