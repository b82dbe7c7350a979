// Launchers of the CUDA Intention forward and backward: run the chain that intention_plan.h plans,
// dispatching each GEMM step to its (operand types) instantiation. Five GEMM instantiations in all:
// <S, S, f32> and <S, f32, S> per dtype S (coinciding for fp32) and <f32, f32, f32>.
#include "intention.cuh"

#include "batched_cholesky.cuh"
#include "common/device_limits.h"
#include "common/launch.cuh"
#include "intention_kernel.cuh"
#include "intention_plan.h"
#include "small_gemm_kernel.cuh"

namespace attn_ext {
namespace cuda {
namespace {

template <typename TA, typename TB, typename TC>
cudaError_t launch_gemm(const SmallGemmParams& g, std::size_t smem_limit, cudaStream_t stream) {
  const SmallGemmLaunchPlan plan = plan_small_gemm(g.batch * g.heads, g.rows, g.cols, smem_limit);
  if (!plan.supported) return cudaErrorInvalidValue;
  if (plan.empty) return cudaSuccess;
  detail::small_gemm_kernel<TA, TB, TC>
      <<<dim3(plan.grid.x, plan.grid.y), dim3(plan.block.x), plan.shared_memory_bytes, stream>>>(g);
  return cudaGetLastError();
}

template <typename S>
cudaError_t run_step(const IntentionStep& st, std::size_t smem_limit, cudaStream_t stream) {
  switch (st.kind) {
    case IntentionStep::kGemmSSF: return launch_gemm<S, S, float>(st.gemm, smem_limit, stream);
    case IntentionStep::kGemmSFS: return launch_gemm<S, float, S>(st.gemm, smem_limit, stream);
    case IntentionStep::kGemmFFF: return launch_gemm<float, float, float>(st.gemm, smem_limit, stream);
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

template <typename S>
cudaError_t run_plan(const IntentionPlan& plan, std::size_t smem_limit, cudaStream_t stream) {
  for (int i = 0; i < plan.count; ++i) {
    const cudaError_t err = run_step<S>(plan.steps[i], smem_limit, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

/// Plans the chain for the current device and runs it; a rejected chain (its plan checked every step)
/// enqueues nothing.
template <typename Params, typename Planner>
cudaError_t run(const Params& p, Planner planner, cudaStream_t stream) {
  std::size_t smem_limit = 0;
  const cudaError_t err = current_smem_optin_limit(&smem_limit);
  if (err != cudaSuccess) return err;
  const IntentionPlan plan = planner(p, smem_limit);
  if (!plan.supported) return cudaErrorInvalidValue;
  return detail::dispatch_attention_dtype(
      p.in.dtype, [&](auto scalar) { return run_plan<decltype(scalar)>(plan, smem_limit, stream); });
}

}  // namespace

cudaError_t launch_intention_fwd(const IntentionFwdParams& p, cudaStream_t stream) {
  if (p.in.B * p.in.H == 0) return cudaSuccess;
  if (p.in.q == nullptr || (p.in.N > 0 && (p.in.k == nullptr || (p.in.has_values && p.in.v == nullptr))) ||
      p.alpha == nullptr || p.out == nullptr || p.factor == nullptr ||
      p.weights == nullptr || p.stats == nullptr || p.info == nullptr) {
    return cudaErrorInvalidValue;
  }
  return run(p, plan_intention_fwd, stream);
}

cudaError_t launch_intention_bwd(const IntentionBwdParams& p, cudaStream_t stream) {
  if (p.in.B * p.in.H == 0) return cudaSuccess;
  if (p.grad_out == nullptr || p.in.q == nullptr || (p.in.N > 0 && (p.in.k == nullptr || p.grad_k == nullptr)) ||
      p.factor == nullptr || p.weights == nullptr ||
      p.grad_q == nullptr || (p.in.has_values && p.in.N > 0 && (p.in.v == nullptr || p.grad_v == nullptr)) ||
      p.grad_alpha == nullptr || p.db == nullptr || p.e == nullptr) {
    return cudaErrorInvalidValue;
  }
  return run(p, plan_intention_bwd, stream);
}

}  // namespace cuda
}  // namespace attn_ext
