// Device code of the batched Cholesky factorisation and solves: one block per matrix, the matrix in
// shared memory, the per-entry arithmetic from attn_ext/cholesky.h (so the CPU header tests cover it).
//
// Factorisation, left-looking by columns: for column j every thread reduces its rows i ≥ j with
// cholesky_reduced_entry (columns < j are final, so rows are independent), then the pivot is checked
// and the column scaled. Three barriers per column, O(n) work per thread per column. The summation
// order per entry is that of cholesky_lower_inplace, so both give the same L up to FMA contraction.
//
// Solves: thread c owns right-hand side c and runs cholesky_solve_inplace on it (r = 1, leading
// dimension = X's row stride) in global memory, reading L from shared memory as broadcasts: columns
// are independent, so no barrier is needed after L is loaded.
//
// Included by batched_cholesky.cu (nvcc) and by csrc/tests/cuda_{cholesky,intention}_emulation_test.cpp
// (g++ with the shims of csrc/tests/cuda_emulation/).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "attn_ext/cholesky.h"
#include "batched_cholesky.cuh"

namespace attn_ext {
namespace cuda {
namespace detail {

/// Factorises the n×n matrix `a` (leading dimension ld, lower triangle) in shared memory in place,
/// cooperatively by the whole block; returns the same info on every thread (0 or bad column + 1).
template <typename T>
__device__ __forceinline__ int cholesky_factor_shared(T* a, int n, int ld) {
  for (int j = 0; j < n; ++j) {
    const T* row_j = a + j * ld;
    for (int i = j + static_cast<int>(threadIdx.x); i < n; i += static_cast<int>(blockDim.x)) {
      a[i * ld + j] = cholesky_reduced_entry(a + i * ld, row_j, j);
    }
    __syncthreads();
    const T pivot = row_j[j];
    if (!cholesky_pivot_ok(pivot)) return j + 1;  // block-uniform: every thread read the same pivot
    const T diag = math_sqrt(pivot);
    __syncthreads();  // everybody has read the pivot before row j's thread overwrites it
    for (int i = j + static_cast<int>(threadIdx.x); i < n; i += static_cast<int>(blockDim.x)) {
      a[i * ld + j] = i == j ? diag : a[i * ld + j] / diag;
    }
    __syncthreads();
  }
  return 0;
}

/// Loads the lower triangle of matrix `m` of `src` (+ shift on the diagonal) into shared memory.
template <typename T>
__device__ __forceinline__ void cholesky_load_lower(T* dst, int ld, const StridedMatrices& src, int64_t m, int n,
                                                    T shift) {
  const T* base = static_cast<const T*>(src.data) + m * src.stride_batch;
  for (int idx = static_cast<int>(threadIdx.x); idx < n * n; idx += static_cast<int>(blockDim.x)) {
    const int i = idx / n, j = idx % n;
    if (j <= i) dst[i * ld + j] = base[i * src.stride_row + j * src.stride_col] + (i == j ? shift : T(0));
  }
}

/// One block per matrix: L and info of batched_cholesky. kPaddedRows: the plan's padded_rows, the
/// leading dimension of the matrix in shared memory (cholesky_smem_ld).
template <typename T, bool kPaddedRows>
__global__ void __launch_bounds__(kCholeskyThreads) batched_cholesky_kernel(const BatchedCholeskyParams p) {
  extern __shared__ float4 smem_raw[];
  T* a = reinterpret_cast<T*>(smem_raw);
  const int n = static_cast<int>(p.n), ld = static_cast<int>(cholesky_smem_ld(n, kPaddedRows));
  const int64_t m = blockIdx.x;
  const T shift = p.diag_shift == nullptr ? T(0) : static_cast<const T*>(p.diag_shift)[m];
  cholesky_load_lower(a, ld, p.a, m, n, shift);
  __syncthreads();
  const int info = cholesky_factor_shared(a, n, ld);
  // On failure at column info − 1 only the columns before it are the factor's (the CPU op's contract).
  const int good_cols = info == 0 ? n : info - 1;
  T* l = static_cast<T*>(p.l) + m * p.n * p.n;
  for (int idx = static_cast<int>(threadIdx.x); idx < n * n; idx += static_cast<int>(blockDim.x)) {
    const int i = idx / n, j = idx % n;
    l[idx] = (j <= i && j < good_cols) ? a[i * ld + j] : T(0);
  }
  if (threadIdx.x == 0) p.info[m] = info;
}

/// Grid (matrix, block of columns): X[:, c] = A⁻¹ B[:, c] for this block's columns.
/// Launch bounds with 2 blocks per SM: with the block size alone ptxas kept the fp64 instantiation
/// at 32 registers and spilled around the double-division subroutine.
template <typename T, bool kPaddedRows>
__global__ void __launch_bounds__(kCholeskyThreads, 2) batched_cholesky_solve_kernel(const BatchedCholeskySolveParams p) {
  extern __shared__ float4 smem_raw[];
  T* l = reinterpret_cast<T*>(smem_raw);
  const int n = static_cast<int>(p.n), ld = static_cast<int>(cholesky_smem_ld(n, kPaddedRows));
  const int64_t m = blockIdx.x;
  cholesky_load_lower(l, ld, p.l, m, n, T(0));
  __syncthreads();
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= p.r) return;  // no barrier below
  T* x = static_cast<T*>(p.x) + m * p.n * p.r;
  const T* b = static_cast<const T*>(p.b.data);
  // Each thread reads its own column before writing it, so x may alias b (in-place solve).
  for (int i = 0; i < n; ++i) {
    x[i * p.r + c] = b == nullptr ? T(i == c ? 1 : 0) : b[m * p.b.stride_batch + i * p.b.stride_row + c * p.b.stride_col];
  }
  cholesky_solve_inplace(l, n, ld, x + c, 1, p.r);
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
