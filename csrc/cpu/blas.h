// Row-major GEMM on raw pointers for the CPU kernels' tiles.
//
// The tiles are small (tens to hundreds of rows), so the per-call overhead of at::mm (dispatcher,
// tensor wrappers) would cost a tenth of the time; we call the BLAS that the torch binary already
// carries instead. Its symbol is looked up at run time (see blas.cpp), and a portable loop takes over
// where the torch build exports none, so the extension loads on every torch build.
#pragma once

#include <cstdint>

namespace attn_ext::cpu {

enum class Transpose : char { kNo = 'N', kYes = 'T' };

/// C[m×n] = alpha · op(A) · op(B) + beta · C, all row-major with leading dimensions lda/ldb/ldc,
/// where op(A) is m×k and op(B) is k×n. beta = 0 overwrites C (NaN/garbage in C is ignored).
void gemm(Transpose trans_a, Transpose trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm(Transpose trans_a, Transpose trans_b, int64_t m, int64_t n, int64_t k, double alpha,
          const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
          int64_t ldc);

/// Which implementation gemm() uses in this process: "blas (<symbol>)" or "portable loops".
const char* gemm_implementation();

}  // namespace attn_ext::cpu
