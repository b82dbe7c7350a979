// Cholesky factorisation and triangular solves of one small SPD matrix (docs/spec.md §4: the Intention op's
// A = KᵀK + αI = L Lᵀ, W = A⁻¹ C, and its backward's A⁻¹(Qᵀ dY)), written once for the host and for a
// future CUDA kernel (one thread or one warp-serial loop per matrix): plain loops over raw pointers,
// no std:: containers, no exceptions, no allocation.
//
// Layout: row-major matrices with a leading dimension (element (i, j) at m[i·ld + j]). The CPU op
// (csrc/cpu/cholesky_simd.cpp) computes the same quantities with register-blocked SIMD kernels; these
// routines are the portable definition, tested in csrc/tests/cholesky_test.cpp.
#pragma once

#include <stdint.h>

#include "attn_ext/macros.h"

namespace attn_ext {

/// True for a usable Cholesky pivot: positive and finite. Written so that NaN fails.
template <typename T>
ATTN_EXT_HOST_DEVICE bool cholesky_pivot_ok(T pivot) {
  return pivot > T(0) && pivot < static_cast<T>(HUGE_VAL);
}

/// The column step of the factorisation: A_ij − Σ_{k<j} L_ik L_jk, for row i ≥ j, where `row_i` and
/// `row_j` point at rows i and j whose first j entries already hold L. For i = j it is column j's
/// pivot (L_jj²), for i > j it is L_ij·L_jj. Every row i ≥ j of one column can be reduced
/// independently, which is how the CUDA kernel (csrc/cuda/batched_cholesky_kernel.cuh) parallelises
/// a column over threads; the sequential loop below uses the same summation order.
template <typename T>
ATTN_EXT_HOST_DEVICE T cholesky_reduced_entry(const T* row_i, const T* row_j, int j) {
  T sum = row_i[j];
  for (int k = 0; k < j; ++k) sum -= row_i[k] * row_j[k];
  return sum;
}

/// In-place lower Cholesky factorisation A = L Lᵀ of the n×n matrix in `a` (leading dimension lda).
///
/// Left-looking by rows (Cholesky–Banachiewicz): for i = 0..n−1 and j = 0..i,
///     L_ij = (A_ij − Σ_{k<j} L_ik L_jk) / L_jj   (j < i),      L_ii = √(A_ii − Σ_{k<i} L_ik²),
/// so row i needs only rows ≤ i and the inner sums run over contiguous row prefixes. Only the lower
/// triangle of `a` is read and overwritten with L; the strictly upper triangle is left untouched.
///
/// Returns 0, or j + 1 when the pivot A_jj − Σ_{k<j} L_jk² of column j is not positive and finite
/// (as LAPACK's potrf info: the leading minor of order j + 1 is not positive definite, or the matrix
/// holds NaN/inf). The pivots are met in column order, so j is the first bad column. On failure, rows
/// < j hold L's first rows and the rest of the lower triangle is partly updated.
template <typename T>
ATTN_EXT_HOST_DEVICE int cholesky_lower_inplace(T* a, int n, int64_t lda) {
  for (int i = 0; i < n; ++i) {
    T* row_i = a + i * lda;
    for (int j = 0; j < i; ++j) {
      const T* row_j = a + j * lda;
      row_i[j] = cholesky_reduced_entry(row_i, row_j, j) / row_j[j];
    }
    const T pivot = cholesky_reduced_entry(row_i, row_i, i);
    if (!cholesky_pivot_ok(pivot)) return i + 1;
    row_i[i] = math_sqrt(pivot);
  }
  return 0;
}

/// Forward substitution L Y = B in place, for the n×n lower-triangular L (leading dimension ldl; its
/// strictly upper triangle is not read) and a block of r right-hand sides B (n×r, leading dimension
/// ldb), overwritten with Y:
///     y_i = (b_i − Σ_{k<i} L_ik y_k) / L_ii      (y_i, b_i: rows of r entries).
/// Row-oriented: the inner loop runs over the r contiguous entries of a row.
template <typename T>
ATTN_EXT_HOST_DEVICE void cholesky_forward_substitution(const T* l, int n, int64_t ldl, T* b, int r, int64_t ldb) {
  for (int i = 0; i < n; ++i) {
    T* y_i = b + i * ldb;
    const T* l_i = l + i * ldl;
    for (int k = 0; k < i; ++k) {
      const T coef = l_i[k];
      const T* y_k = b + k * ldb;
      for (int c = 0; c < r; ++c) y_i[c] -= coef * y_k[c];
    }
    const T diag = l_i[i];
    for (int c = 0; c < r; ++c) y_i[c] /= diag;
  }
}

/// Back substitution Lᵀ X = Y in place, for the same L and Y (n×r, leading dimension ldy),
/// overwritten with X:
///     x_i = (y_i − Σ_{k>i} L_ki x_k) / L_ii,     for i = n−1 down to 0.
template <typename T>
ATTN_EXT_HOST_DEVICE void cholesky_back_substitution(const T* l, int n, int64_t ldl, T* y, int r, int64_t ldy) {
  for (int i = n - 1; i >= 0; --i) {
    T* x_i = y + i * ldy;
    for (int k = i + 1; k < n; ++k) {
      const T coef = l[k * ldl + i];
      const T* x_k = y + k * ldy;
      for (int c = 0; c < r; ++c) x_i[c] -= coef * x_k[c];
    }
    const T diag = l[i * ldl + i];
    for (int c = 0; c < r; ++c) x_i[c] /= diag;
  }
}

/// X = (L Lᵀ)⁻¹ B in place: the forward then the back substitution, i.e. the solve of A X = B with
/// the factor of cholesky_lower_inplace. A zero on L's diagonal gives inf/NaN, as LAPACK's potrs.
template <typename T>
ATTN_EXT_HOST_DEVICE void cholesky_solve_inplace(const T* l, int n, int64_t ldl, T* b, int r, int64_t ldb) {
  cholesky_forward_substitution(l, n, ldl, b, r, ldb);
  cholesky_back_substitution(l, n, ldl, b, r, ldb);
}

}  // namespace attn_ext
