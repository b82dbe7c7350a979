// Host-side interface of the CUDA batched Cholesky factorisation and solves (the attn_ext ops
// batched_cholesky / batched_cholesky_solve, and the factor+solve step of Intention, docs/spec.md §4).
// Only CUDA runtime types (no ATen/c10), like attention_fwd.cuh.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "batched_cholesky_plan.h"

namespace attn_ext {
namespace cuda {

/// A batch of matrices: element (m, i, j) at data[m·stride_batch + i·stride_row + j·stride_col]
/// (element strides, any value ≥ 0 a view produces).
struct StridedMatrices {
  const void* data = nullptr;
  int64_t stride_batch = 0, stride_row = 0, stride_col = 0;
};

/// batched_cholesky: L[m] L[m]ᵀ = A[m] + diag_shift[m]·I, from A's lower triangle.
struct BatchedCholeskyParams {
  StridedMatrices a;               ///< [batch, n, n]
  /// Optional [batch] values added to the diagonal on load (Intention's α); nullptr = none.
  const void* diag_shift = nullptr;
  void* l = nullptr;               ///< [batch, n, n] contiguous; zeros above the diagonal
  int32_t* info = nullptr;         ///< [batch]: 0, or j + 1 for a bad pivot at column j (cholesky_ex)
  int64_t batch = 0, n = 0;
  ScalarType dtype = ScalarType::kFloat32;  ///< or kFloat64
};

/// batched_cholesky_solve: X[m] = (L[m] L[m]ᵀ)⁻¹ B[m].
struct BatchedCholeskySolveParams {
  StridedMatrices l;   ///< [batch, n, n], lower triangle read
  StridedMatrices b;   ///< [batch, n, r]; data == nullptr means B = I (then r = n): X = A⁻¹
  void* x = nullptr;   ///< [batch, n, r] contiguous; may alias b's storage when b is contiguous too
  int64_t batch = 0, n = 0, r = 0;
  ScalarType dtype = ScalarType::kFloat32;  ///< or kFloat64
};

/// Enqueues the factorisation (one block per matrix, the matrix in shared memory). On a bad pivot at
/// column j, L's columns < j hold the factor and the rest is 0, as the CPU op. Returns
/// cudaErrorInvalidValue for n > 128, a matrix that does not fit the current device's shared memory
/// (batched_cholesky_plan.h), or null pointers, else the launch's error.
cudaError_t launch_batched_cholesky(const BatchedCholeskyParams& p, cudaStream_t stream);

/// Enqueues the solves (one block per matrix and 128 right-hand sides; one thread per column).
cudaError_t launch_batched_cholesky_solve(const BatchedCholeskySolveParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace attn_ext
