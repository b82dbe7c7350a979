// Launchers of the batched Cholesky kernels: plan (batched_cholesky_plan.h), opt in to the shared
// memory the factor needs, dispatch float/double.
#include "batched_cholesky.cuh"

#include "batched_cholesky_kernel.cuh"
#include "common/launch.cuh"

namespace attn_ext {
namespace cuda {

cudaError_t launch_batched_cholesky(const BatchedCholeskyParams& p, cudaStream_t stream) {
  const CholeskyLaunchPlan plan = plan_batched_cholesky(p.batch, p.n, -1, p.dtype);
  if (!plan.supported) return cudaErrorInvalidValue;
  if (plan.empty) return cudaSuccess;
  if (p.a.data == nullptr || p.l == nullptr || p.info == nullptr) return cudaErrorInvalidValue;
  const auto launch = [&](auto kernel) {
    return detail::launch_with_smem(kernel, plan.grid, plan.block, plan.shared_memory_bytes, stream, p);
  };
  return p.dtype == ScalarType::kFloat64 ? launch(detail::batched_cholesky_kernel<double>)
                                         : launch(detail::batched_cholesky_kernel<float>);
}

cudaError_t launch_batched_cholesky_solve(const BatchedCholeskySolveParams& p, cudaStream_t stream) {
  const CholeskyLaunchPlan plan = plan_batched_cholesky(p.batch, p.n, p.r, p.dtype);
  if (!plan.supported) return cudaErrorInvalidValue;
  if (plan.empty) return cudaSuccess;
  if (p.l.data == nullptr || p.x == nullptr || (p.b.data == nullptr && p.r != p.n)) return cudaErrorInvalidValue;
  const auto launch = [&](auto kernel) {
    return detail::launch_with_smem(kernel, plan.grid, plan.block, plan.shared_memory_bytes, stream, p);
  };
  return p.dtype == ScalarType::kFloat64 ? launch(detail::batched_cholesky_solve_kernel<double>)
                                         : launch(detail::batched_cholesky_solve_kernel<float>);
}

}  // namespace cuda
}  // namespace attn_ext
