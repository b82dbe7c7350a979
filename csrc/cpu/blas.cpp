#include "blas.h"

#include <dlfcn.h>

#include <algorithm>
#include <mutex>

#include <ATen/Parallel.h>

namespace attn_ext::cpu {
namespace {

// Fortran BLAS (LP64) signatures, as exported by MKL / OpenBLAS inside libtorch_cpu.
using sgemm_fn = void (*)(const char*, const char*, const int*, const int*, const int*, const float*,
                          const float*, const int*, const float*, const int*, const float*, float*,
                          const int*);
using dgemm_fn = void (*)(const char*, const char*, const int*, const int*, const int*, const double*,
                          const double*, const int*, const double*, const int*, const double*,
                          double*, const int*);

struct BlasSymbols {
  sgemm_fn sgemm = nullptr;
  dgemm_fn dgemm = nullptr;
};

// libtorch_cpu is loaded privately (RTLD_LOCAL) by torch._C, so RTLD_DEFAULT may not see its
// symbols: find the library through the address of one of its functions and ask it directly.
const BlasSymbols& blas_symbols() {
  static BlasSymbols symbols = [] {
    BlasSymbols found;
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&at::get_num_threads), &info) == 0 || info.dli_fname == nullptr) {
      return found;
    }
    void* handle = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (handle == nullptr) {
      return found;
    }
    found.sgemm = reinterpret_cast<sgemm_fn>(dlsym(handle, "sgemm_"));
    found.dgemm = reinterpret_cast<dgemm_fn>(dlsym(handle, "dgemm_"));
    return found;
  }();
  return symbols;
}

template <typename T>
T element(const T* x, int64_t ld, Transpose trans, int64_t row, int64_t col) {
  return trans == Transpose::kNo ? x[row * ld + col] : x[col * ld + row];
}

// Correct but slow; only used by torch builds that export no BLAS.
template <typename T>
void gemm_loops(Transpose ta, Transpose tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
                int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      T sum = 0;
      for (int64_t p = 0; p < k; ++p) {
        sum += element(a, lda, ta, i, p) * element(b, ldb, tb, p, j);
      }
      c[i * ldc + j] = alpha * sum + (beta == T(0) ? T(0) : beta * c[i * ldc + j]);
    }
  }
}

// Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: swap the operands and the sizes.
template <typename T, typename Fn>
void call_fortran(Fn fn, Transpose ta, Transpose tb, int64_t m, int64_t n, int64_t k, T alpha,
                  const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  const char trans_b = static_cast<char>(tb);
  const char trans_a = static_cast<char>(ta);
  const int mm = static_cast<int>(n), nn = static_cast<int>(m), kk = static_cast<int>(k);
  // BLAS rejects leading dimensions below the stored row length even when a dimension is 1.
  const int ld_b = static_cast<int>(std::max<int64_t>(ldb, tb == Transpose::kNo ? std::max<int64_t>(n, 1) : std::max<int64_t>(k, 1)));
  const int ld_a = static_cast<int>(std::max<int64_t>(lda, ta == Transpose::kNo ? std::max<int64_t>(k, 1) : std::max<int64_t>(m, 1)));
  const int ld_c = static_cast<int>(std::max<int64_t>(ldc, std::max<int64_t>(n, 1)));
  fn(&trans_b, &trans_a, &mm, &nn, &kk, &alpha, b, &ld_b, a, &ld_a, &beta, c, &ld_c);
}

// BLAS when this torch exports it (`fn` found), the portable loops otherwise.
template <typename T, typename Fn>
void gemm_with(Fn fn, Transpose ta, Transpose tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
               const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (fn != nullptr) {
    call_fortran(fn, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    gemm_loops(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

}  // namespace

void gemm(Transpose ta, Transpose tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  gemm_with(blas_symbols().sgemm, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void gemm(Transpose ta, Transpose tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
          int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  gemm_with(blas_symbols().dgemm, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

const char* gemm_implementation() {
  return blas_symbols().sgemm != nullptr ? "blas (sgemm_ from libtorch_cpu)" : "portable loops";
}

}  // namespace attn_ext::cpu
