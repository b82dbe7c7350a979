// Launchers of the batched Cholesky kernels: plan (batched_cholesky_plan.h), opt in to the shared
// memory the factor needs, dispatch float/double.
#include "batched_cholesky.cuh"

#include "batched_cholesky_kernel.cuh"

namespace attn_ext {
namespace cuda {
namespace {

constexpr std::size_t kDefaultDynamicSmemLimit = 48 * 1024;

template <typename Kernel, typename Params>
cudaError_t launch(Kernel kernel, const CholeskyLaunchPlan& plan, const Params& p, cudaStream_t stream) {
  if (plan.shared_memory_bytes > kDefaultDynamicSmemLimit) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(plan.shared_memory_bytes));
    if (err != cudaSuccess) return err;
  }
  kernel<<<dim3(plan.grid.x, plan.grid.y, plan.grid.z), dim3(plan.block.x), plan.shared_memory_bytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_batched_cholesky(const BatchedCholeskyParams& p, cudaStream_t stream) {
  const CholeskyLaunchPlan plan = plan_batched_cholesky(p.batch, p.n, -1, p.dtype);
  if (!plan.supported) return cudaErrorInvalidValue;
  if (plan.empty) return cudaSuccess;
  if (p.a.data == nullptr || p.l == nullptr || p.info == nullptr) return cudaErrorInvalidValue;
  if (p.dtype == CholeskyScalar::kFloat64) return launch(detail::batched_cholesky_kernel<double>, plan, p, stream);
  return launch(detail::batched_cholesky_kernel<float>, plan, p, stream);
}

cudaError_t launch_batched_cholesky_solve(const BatchedCholeskySolveParams& p, cudaStream_t stream) {
  const CholeskyLaunchPlan plan = plan_batched_cholesky(p.batch, p.n, p.r, p.dtype);
  if (!plan.supported) return cudaErrorInvalidValue;
  if (plan.empty) return cudaSuccess;
  if (p.l.data == nullptr || p.x == nullptr || (p.b.data == nullptr && p.r != p.n)) return cudaErrorInvalidValue;
  if (p.dtype == CholeskyScalar::kFloat64) {
    return launch(detail::batched_cholesky_solve_kernel<double>, plan, p, stream);
  }
  return launch(detail::batched_cholesky_solve_kernel<float>, plan, p, stream);
}

}  // namespace cuda
}  // namespace attn_ext
