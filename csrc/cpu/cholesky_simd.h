// Register-blocked Cholesky factorisation and solves of batches of small SPD matrices (n up to a few
// hundred): the per-thread work of the ops in batched_cholesky.cpp. Torch-free, raw pointers only.
//
// Inputs are strided views (any strides ≥ 0); outputs are written contiguous and row-major. Each
// call handles the matrices [begin, end) of its batch with one scratch buffer, so that a caller can
// hand every thread one contiguous range. The kernels are compiled for AVX-512, AVX2 and baseline
// x86-64 and picked per call from the CPU; the environment variable ATTN_EXT_CPU_ISA=avx2|baseline
// caps the choice (for tests and comparisons).
#pragma once

#include <cstdint>

namespace attn_ext::cpu {

/// Element (m, i, j) of a strided batch of matrices is at data[m·batch + i·row + j·col].
struct BatchStrides {
  int64_t batch, row, col;
};

/// Lower Cholesky factors L (A = L Lᵀ) of the n×n matrices A[m], m ∈ [begin, end), of which only the
/// lower triangles are read. Writes l[m] (n×n, contiguous, zeros above the diagonal) and info[m]:
/// 0, or j + 1 (as LAPACK's potrf) when the pivot of column j is not positive and finite (A[m] is
/// not positive definite, or holds NaN/inf); then l[m]'s columns < j are the factor's, the rest 0.
void cholesky_factor_batch(const float* a, BatchStrides a_strides, float* l, int32_t* info, int64_t n,
                           int64_t begin, int64_t end);
void cholesky_factor_batch(const double* a, BatchStrides a_strides, double* l, int32_t* info, int64_t n,
                           int64_t begin, int64_t end);

/// X[m] = (L[m] L[m]ᵀ)⁻¹ B[m] for n×n lower factors L (only their lower triangles are read) and n×r
/// right-hand sides B, m ∈ [begin, end): a forward substitution L Y = B, then a back substitution
/// Lᵀ X = Y. Writes x[m] (n×r, contiguous). A zero on L's diagonal gives inf/NaN, as LAPACK's potrs.
void cholesky_solve_batch(const float* l, BatchStrides l_strides, const float* b, BatchStrides b_strides, float* x,
                          int64_t n, int64_t r, int64_t begin, int64_t end);
void cholesky_solve_batch(const double* l, BatchStrides l_strides, const double* b, BatchStrides b_strides,
                          double* x, int64_t n, int64_t r, int64_t begin, int64_t end);

/// X[m] = A[m]⁻¹ B[m] for SPD n×n matrices A (lower triangles read) and n×r right-hand sides B,
/// m ∈ [begin, end): the factorisation and both substitutions per matrix, the factor kept in scratch.
/// info[m] as cholesky_factor_batch; where it is nonzero, x[m] is all NaN (there is no solution to give).
void cholesky_factor_solve_batch(const float* a, BatchStrides a_strides, const float* b, BatchStrides b_strides,
                                 float* x, int32_t* info, int64_t n, int64_t r, int64_t begin, int64_t end);
void cholesky_factor_solve_batch(const double* a, BatchStrides a_strides, const double* b, BatchStrides b_strides,
                                 double* x, int32_t* info, int64_t n, int64_t r, int64_t begin, int64_t end);

}  // namespace attn_ext::cpu
