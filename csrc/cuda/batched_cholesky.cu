// Launchers of the batched Cholesky kernels: plan (batched_cholesky_plan.h) for the current device,
// opt in to the shared memory the factor needs, dispatch float/double and padded/unpadded rows.
#include "batched_cholesky.cuh"

#include "batched_cholesky_kernel.cuh"
#include "common/device_limits.h"
#include "common/launch.cuh"

namespace attn_ext {
namespace cuda {

cudaError_t launch_batched_cholesky(const BatchedCholeskyParams& p, cudaStream_t stream) {
  std::size_t smem_limit = 0;
  const cudaError_t err = current_smem_optin_limit(&smem_limit);
  if (err != cudaSuccess) return err;
  const CholeskyLaunchPlan plan = plan_batched_cholesky(p.batch, p.n, -1, p.dtype, smem_limit);
  if (!plan.supported) return cudaErrorInvalidValue;
  if (plan.empty) return cudaSuccess;
  if (p.a.data == nullptr || p.l == nullptr || p.info == nullptr) return cudaErrorInvalidValue;
  const auto launch = [&](auto kernel) {
    return detail::launch_with_smem(kernel, plan.grid, plan.block, plan.shared_memory_bytes, stream, p);
  };
  // fp64 has padded rows only (batched_cholesky_plan.h).
  if (p.dtype == ScalarType::kFloat64) return launch(detail::batched_cholesky_kernel<double, true>);
  return plan.padded_rows ? launch(detail::batched_cholesky_kernel<float, true>)
                          : launch(detail::batched_cholesky_kernel<float, false>);
}

cudaError_t launch_batched_cholesky_solve(const BatchedCholeskySolveParams& p, cudaStream_t stream) {
  std::size_t smem_limit = 0;
  const cudaError_t err = current_smem_optin_limit(&smem_limit);
  if (err != cudaSuccess) return err;
  const CholeskyLaunchPlan plan = plan_batched_cholesky(p.batch, p.n, p.r, p.dtype, smem_limit);
  if (!plan.supported) return cudaErrorInvalidValue;
  if (plan.empty) return cudaSuccess;
  if (p.l.data == nullptr || p.x == nullptr || (p.b.data == nullptr && p.r != p.n)) return cudaErrorInvalidValue;
  const auto launch = [&](auto kernel) {
    return detail::launch_with_smem(kernel, plan.grid, plan.block, plan.shared_memory_bytes, stream, p);
  };
  if (p.dtype == ScalarType::kFloat64) return launch(detail::batched_cholesky_solve_kernel<double, true>);
  return plan.padded_rows ? launch(detail::batched_cholesky_solve_kernel<float, true>)
                          : launch(detail::batched_cholesky_solve_kernel<float, false>);
}

}  // namespace cuda
}  // namespace attn_ext
