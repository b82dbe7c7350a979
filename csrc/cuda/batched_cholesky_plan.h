// Launch geometry of the CUDA batched Cholesky factorisation and solves (docs/spec.md §4), as plain C++17.
//
// Free of CUDA headers so that the host tests (csrc/tests/cuda_cholesky_emulation_test.cpp) check
// exactly the grid, block and shared-memory size the launcher in batched_cholesky.cu uses.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/launch_geometry.h"

namespace attn_ext {
namespace cuda {

/// Largest n with a kernel: the whole factor must fit in one block's shared memory.
constexpr int kCholeskyMaxDim = 128;
/// Threads per block: one thread per row of a column step, and one per right-hand side in the solve.
constexpr int kCholeskyThreads = 128;
/// Opt-in dynamic shared memory guaranteed by both compiled architectures (sm_80: 163 KiB).
constexpr std::size_t kCholeskyMaxSmemBytes = 163 * 1024;

/// Leading dimension of the matrix in shared memory: n + 1 is odd, so that the threads of a column
/// step, which read rows i = j, j + 1, ... at the same column, hit distinct banks.
constexpr int64_t cholesky_smem_ld(int64_t n) { return n + 1; }

/// Dynamic shared memory of the factor and of the solve kernels: one n×(n+1) matrix.
constexpr std::size_t cholesky_smem_bytes(int64_t n, ScalarType dtype) {
  return static_cast<std::size_t>(n * cholesky_smem_ld(n)) * element_size(dtype);
}

/// What a launcher will do: `empty` = nothing to launch (batch, n or r is 0).
struct CholeskyLaunchPlan {
  bool supported = false;
  const char* error = nullptr;
  bool empty = false;
  LaunchDims grid;   ///< factor: x = matrix; solve: x = matrix, y = block of kCholeskyThreads columns
  LaunchDims block;  ///< kCholeskyThreads
  std::size_t shared_memory_bytes = 0;
};

/// Plans batched_cholesky (r < 0) or batched_cholesky_solve with r right-hand sides (r ≥ 0) for a
/// batch of n×n matrices.
inline CholeskyLaunchPlan plan_batched_cholesky(int64_t batch, int64_t n, int64_t r, ScalarType dtype) {
  CholeskyLaunchPlan plan;
  // float32 and float64 only, as on the CPU: a half-precision factor would be too inexact to return.
  if (dtype != ScalarType::kFloat32 && dtype != ScalarType::kFloat64) {
    plan.error = "the Cholesky kernels take float32 or float64";
    return plan;
  }
  if (batch < 0 || n < 0) {
    plan.error = "negative size";
    return plan;
  }
  if (n > kCholeskyMaxDim) {
    plan.error = "the CUDA Cholesky kernels support n <= 128 (the factor is held in shared memory)";
    return plan;
  }
  plan.block.x = kCholeskyThreads;
  plan.shared_memory_bytes = cholesky_smem_bytes(n, dtype);
  if (plan.shared_memory_bytes > kCholeskyMaxSmemBytes) {
    plan.error = "shared memory of the factor exceeds the opt-in limit";
    return plan;
  }
  plan.supported = true;
  if (batch == 0 || n == 0 || r == 0) {
    plan.empty = true;
    plan.grid.x = 0;
    return plan;
  }
  const int64_t col_blocks = r < 0 ? 1 : (r + kCholeskyThreads - 1) / kCholeskyThreads;
  if (batch > kMaxGridX || col_blocks > kMaxGridY) {
    plan.supported = false;
    plan.error = "too many matrices or right-hand sides for the CUDA grid";
    return plan;
  }
  plan.grid.x = static_cast<unsigned int>(batch);
  plan.grid.y = static_cast<unsigned int>(col_blocks);
  return plan;
}

}  // namespace cuda
}  // namespace attn_ext
