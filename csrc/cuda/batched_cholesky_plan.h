// Launch geometry of the CUDA batched Cholesky factorisation and solves (docs/spec.md §4), as plain C++17.
//
// Free of CUDA headers so that the host tests (csrc/tests/cuda_cholesky_emulation_test.cpp) check
// exactly the grid, block and shared-memory size the launcher in batched_cholesky.cu uses.
#pragma once

#include <cstddef>
#include <cstdint>

#include "attn_ext/macros.h"
#include "common/launch_geometry.h"
#include "common/smem_limits.h"

namespace attn_ext {
namespace cuda {

/// Largest n with a kernel: the whole factor must fit in one block's shared memory.
constexpr int kCholeskyMaxDim = 128;
/// Threads per block: one thread per row of a column step, and one per right-hand side in the solve.
constexpr int kCholeskyThreads = 128;
/// Leading dimension of the matrix in shared memory. Padded rows (n + 1, odd) make the threads of a
/// column step, which read rows i = j, j + 1, ... at the same column, hit distinct banks; unpadded rows
/// (n) are the fall-back of fp32 at n = 128 on 64 KiB devices (sm_75), where the padded matrix needs
/// 512 bytes too many. fp64 gains nothing from it at 64 or 96 KiB (n ≤ 90, n ≤ 110 either way), so
/// only fp32 compiles the unpadded kernels. Host and device: the kernels compute their leading
/// dimension with it, so plan and kernel agree.
ATTN_EXT_HOST_DEVICE constexpr int64_t cholesky_smem_ld(int64_t n, bool padded_rows) {
  return padded_rows ? n + 1 : n;
}

/// Dynamic shared memory of the factor and of the solve kernels: one n×ld matrix.
constexpr std::size_t cholesky_smem_bytes(int64_t n, ScalarType dtype, bool padded_rows) {
  return static_cast<std::size_t>(n * cholesky_smem_ld(n, padded_rows)) * element_size(dtype);
}

/// What a launcher will do: `empty` = nothing to launch (batch, n or r is 0).
struct CholeskyLaunchPlan {
  bool supported = false;
  const char* error = nullptr;
  bool empty = false;
  LaunchDims grid;   ///< factor: x = matrix; solve: x = matrix, y = block of kCholeskyThreads columns
  LaunchDims block;  ///< kCholeskyThreads
  std::size_t shared_memory_bytes = 0;
  bool padded_rows = true;  ///< the kernels' leading dimension: n + 1, or n (fp32 only)
  SmemShortfall smem;       ///< set when the matrix does not fit the device
};

/// Plans batched_cholesky (r < 0) or batched_cholesky_solve with r right-hand sides (r ≥ 0) for a
/// batch of n×n matrices, on a device with `smem_limit` bytes of opt-in shared memory per block.
inline CholeskyLaunchPlan plan_batched_cholesky(int64_t batch, int64_t n, int64_t r, ScalarType dtype,
                                                std::size_t smem_limit) {
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
  plan.padded_rows = cholesky_smem_bytes(n, dtype, true) <= smem_limit || dtype != ScalarType::kFloat32;
  plan.shared_memory_bytes = cholesky_smem_bytes(n, dtype, plan.padded_rows);
  if (plan.shared_memory_bytes > smem_limit) {
    plan.error = smem_shortfall(plan.smem, r < 0 ? "batched Cholesky factorisation (one matrix per block)"
                                                 : "batched Cholesky solve (one matrix per block)",
                                plan.shared_memory_bytes, smem_limit);
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
