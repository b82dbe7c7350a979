// Register-blocked Cholesky factorisation and solves of small SPD matrices (see cholesky_simd.h).
//
// Both are row-oriented substitutions whose inner loops run over contiguous rows:
//  * the solve keeps Y (n×r) row-major, so y_i = (b_i − Σ_{k<i} L_ik y_k) / L_ii updates all r
//    right-hand sides of row i with one broadcast coefficient per finished row k (and the back
//    substitution likewise from the bottom, with L_ki);
//  * the factorisation works on U = Lᵀ stored row-major (L column-major), whose row i over the
//    columns ≥ i is u_i = (a_i − Σ_{k<i} U_ki u_k) / U_ii with U_ii² the pivot: the same
//    substitution (left-looking, Crout order), the rows of U playing the part of Y's rows.
// The micro-kernel updates R = 6 rows × a panel of vectors at once, its accumulators in registers
// over the whole k loop: on AVX-512, 6 × 4 zmm (64 floats or 32 doubles per row), so each k costs 4
// vector loads and 6 broadcasts for 24 FMAs; on AVX2 and SSE2 (16 registers), 6 × 2 vectors. Rows
// are padded to whole blocks and whole vectors in a scratch buffer (the padding rows compute zeros
// and are dropped), which also frees the kernels from the input strides. Reading A's lower triangle
// into U and writing L = Uᵀ out are in-register tile transposes.
#include "cholesky_simd.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "cholesky_blocks.h"
#include "cholesky_matrix.h"
#include "isa_level.h"
#include "simd_vector.h"

namespace attn_ext::cpu {
namespace {

using cholesky::Avx2;
using cholesky::Avx512;
using cholesky::Baseline;
using cholesky::BlockArgs;
using cholesky::Finish;
using cholesky::kBlockRows;
using cholesky::kLanes;
using cholesky::update_rows;
using simd::round_up;
using cholesky::factor_matrix;
using cholesky::factor_matrix_in_place;
using cholesky::NextMatrix;
using cholesky::SolveScratch;
using cholesky::solve_matrix;
using cholesky::store_lower_transposed;
using cholesky::substitute;

template <typename T, typename I>
ATTN_EXT_ALWAYS_INLINE void factor_batch(const T* a, const BatchStrides& s, T* l, int32_t* info, int64_t n,
                                         int64_t begin, int64_t end) {
  const int64_t ld = round_up(n, kLanes<T, I>), rows = round_up(n, kBlockRows);
  std::vector<T> storage(rows * ld + 64 / sizeof(T));
  T* u = reinterpret_cast<T*>(round_up(reinterpret_cast<intptr_t>(storage.data()), 64));
  const int64_t blocks = rows / kBlockRows;
  for (int64_t m = begin; m < end; ++m) {
    NextMatrix next;
    if (m + 1 < end) {
      next.input = simd::Prefetch::span(a + (m + 1) * s.batch, n, n, s.row, s.col, blocks);
      next.output = simd::Prefetch::span(l + (m + 1) * n * n, n, n, n, 1, blocks, true);
    }
    info[m] = factor_matrix<T, I>(a + m * s.batch, s, l + m * n * n, n, u, next);
  }
}

template <typename T, typename I>
ATTN_EXT_ALWAYS_INLINE void solve_batch(const T* l, const BatchStrides& ls, const T* b, const BatchStrides& bs, T* x,
                                        int64_t n, int64_t r, int64_t begin, int64_t end) {
  std::vector<T> storage(SolveScratch<T, I>(n, r, nullptr).elements() + 64 / sizeof(T));
  const SolveScratch<T, I> scratch(n, r,
                                   reinterpret_cast<T*>(round_up(reinterpret_cast<intptr_t>(storage.data()), 64)));
  const int64_t steps = 2 * scratch.rows / kBlockRows;  // blocks of the forward and the back substitution
  for (int64_t m = begin; m < end; ++m) {
    NextMatrix next;
    if (m + 1 < end) {
      next.input = simd::Prefetch::span(l + (m + 1) * ls.batch, n, n, ls.row, ls.col, steps);
      next.second_input = simd::Prefetch::span(b + (m + 1) * bs.batch, n, r, bs.row, bs.col, steps);
      next.output = simd::Prefetch::span(x + (m + 1) * n * r, n, r, r, 1, steps, true);
    }
    solve_matrix<T, I>(l + m * ls.batch, ls, b + m * bs.batch, bs, x + m * n * r, n, r, scratch, next);
  }
}

/// Factor and solve per matrix with the factor kept in the thread's scratch: L is never written to
/// memory outside the cache, which halves the output traffic of factor-then-solve (for a batch of
/// fresh outputs the first-touch page faults of L would cost as much as the arithmetic).
template <typename T, typename I>
ATTN_EXT_ALWAYS_INLINE void factor_solve_batch(const T* a, const BatchStrides& as, const T* b, const BatchStrides& bs,
                                               T* x, int32_t* info, int64_t n, int64_t r, int64_t begin,
                                               int64_t end) {
  constexpr int64_t kAlign = 64 / sizeof(T);
  const int64_t ld = round_up(n, kLanes<T, I>), rows = round_up(n, kBlockRows);
  const int64_t u_elements = round_up(rows * ld, kAlign);
  // Zeroed once: the factor copy's padding rows and columns ≥ n, and 1/L_ii of padding rows, are
  // never written below and must read as 0 in the substitutions.
  std::vector<T> storage(u_elements + SolveScratch<T, I>(n, r, nullptr).elements() + kAlign);
  T* u = reinterpret_cast<T*>(round_up(reinterpret_cast<intptr_t>(storage.data()), 64));
  const SolveScratch<T, I> w(n, r, u + u_elements);
  const int64_t steps = 3 * rows / kBlockRows;  // blocks of the factorisation and of both substitutions
  for (int64_t m = begin; m < end; ++m) {
    NextMatrix next;
    if (m + 1 < end) {
      next.input = simd::Prefetch::span(a + (m + 1) * as.batch, n, n, as.row, as.col, steps);
      next.second_input = simd::Prefetch::span(b + (m + 1) * bs.batch, n, r, bs.row, bs.col, steps);
      next.output = simd::Prefetch::span(x + (m + 1) * n * r, n, r, r, 1, steps, true);
    }
    T* x_m = x + m * n * r;
    info[m] = factor_matrix_in_place<T, I>(a + m * as.batch, as, n, u, next);
    if (info[m] != 0) {  // not positive definite: no solution to report, and NaN cannot pass for one
      std::fill(x_m, x_m + n * r, std::numeric_limits<T>::quiet_NaN());
      continue;
    }
    store_lower_transposed<T, I>(u, ld, w.l, n, w.ld_l);
    for (int64_t i = 0; i < n; ++i) w.inv_diag[i] = T(1) / w.l[i * w.ld_l + i];
    substitute<T, I>(b + m * bs.batch, bs, x_m, n, r, w, next);
  }
}

// One compiled copy of the kernels per instruction set, each with the vector and panel widths that
// fit its registers (target_clones would compile one configuration for all three), chosen per call.
#define ATTN_EXT_CHOLESKY_KERNELS(T, name, target, I)                                                    \
  target void factor_##name(const T* a, BatchStrides s, T* l, int32_t* info, int64_t n, int64_t begin,  \
                            int64_t end) {                                                              \
    factor_batch<T, I>(a, s, l, info, n, begin, end);                                                   \
  }                                                                                                     \
  target void solve_##name(const T* l, BatchStrides ls, const T* b, BatchStrides bs, T* x, int64_t n,   \
                           int64_t r, int64_t begin, int64_t end) {                                     \
    solve_batch<T, I>(l, ls, b, bs, x, n, r, begin, end);                                               \
  }                                                                                                     \
  target void factor_solve_##name(const T* a, BatchStrides as, const T* b, BatchStrides bs, T* x,       \
                                  int32_t* info, int64_t n, int64_t r, int64_t begin, int64_t end) {    \
    factor_solve_batch<T, I>(a, as, b, bs, x, info, n, r, begin, end);                                  \
  }

ATTN_EXT_CHOLESKY_KERNELS(float, baseline, , Baseline)
ATTN_EXT_CHOLESKY_KERNELS(double, baseline, , Baseline)
#ifdef ATTN_EXT_X86_KERNELS
ATTN_EXT_CHOLESKY_KERNELS(float, avx2, ATTN_EXT_TARGET("arch=x86-64-v3"), Avx2)
ATTN_EXT_CHOLESKY_KERNELS(double, avx2, ATTN_EXT_TARGET("arch=x86-64-v3"), Avx2)
ATTN_EXT_CHOLESKY_KERNELS(float, avx512, ATTN_EXT_TARGET("arch=x86-64-v4"), Avx512)
ATTN_EXT_CHOLESKY_KERNELS(double, avx512, ATTN_EXT_TARGET("arch=x86-64-v4"), Avx512)
#endif

template <typename T>
void factor_dispatch(const T* a, BatchStrides s, T* l, int32_t* info, int64_t n, int64_t begin, int64_t end) {
  switch (isa_level()) {
#ifdef ATTN_EXT_X86_KERNELS
    case IsaLevel::kAvx512: return factor_avx512(a, s, l, info, n, begin, end);
    case IsaLevel::kAvx2: return factor_avx2(a, s, l, info, n, begin, end);
#endif
    default: return factor_baseline(a, s, l, info, n, begin, end);
  }
}

template <typename T>
void solve_dispatch(const T* l, BatchStrides ls, const T* b, BatchStrides bs, T* x, int64_t n, int64_t r,
                    int64_t begin, int64_t end) {
  switch (isa_level()) {
#ifdef ATTN_EXT_X86_KERNELS
    case IsaLevel::kAvx512: return solve_avx512(l, ls, b, bs, x, n, r, begin, end);
    case IsaLevel::kAvx2: return solve_avx2(l, ls, b, bs, x, n, r, begin, end);
#endif
    default: return solve_baseline(l, ls, b, bs, x, n, r, begin, end);
  }
}

template <typename T>
void factor_solve_dispatch(const T* a, BatchStrides as, const T* b, BatchStrides bs, T* x, int32_t* info, int64_t n,
                           int64_t r, int64_t begin, int64_t end) {
  switch (isa_level()) {
#ifdef ATTN_EXT_X86_KERNELS
    case IsaLevel::kAvx512: return factor_solve_avx512(a, as, b, bs, x, info, n, r, begin, end);
    case IsaLevel::kAvx2: return factor_solve_avx2(a, as, b, bs, x, info, n, r, begin, end);
#endif
    default: return factor_solve_baseline(a, as, b, bs, x, info, n, r, begin, end);
  }
}

}  // namespace

void cholesky_factor_batch(const float* a, BatchStrides a_strides, float* l, int32_t* info, int64_t n, int64_t begin,
                           int64_t end) {
  factor_dispatch(a, a_strides, l, info, n, begin, end);
}

void cholesky_factor_batch(const double* a, BatchStrides a_strides, double* l, int32_t* info, int64_t n,
                           int64_t begin, int64_t end) {
  factor_dispatch(a, a_strides, l, info, n, begin, end);
}

void cholesky_solve_batch(const float* l, BatchStrides l_strides, const float* b, BatchStrides b_strides, float* x,
                          int64_t n, int64_t r, int64_t begin, int64_t end) {
  solve_dispatch(l, l_strides, b, b_strides, x, n, r, begin, end);
}

void cholesky_solve_batch(const double* l, BatchStrides l_strides, const double* b, BatchStrides b_strides,
                          double* x, int64_t n, int64_t r, int64_t begin, int64_t end) {
  solve_dispatch(l, l_strides, b, b_strides, x, n, r, begin, end);
}

void cholesky_factor_solve_batch(const float* a, BatchStrides a_strides, const float* b, BatchStrides b_strides,
                                 float* x, int32_t* info, int64_t n, int64_t r, int64_t begin, int64_t end) {
  factor_solve_dispatch(a, a_strides, b, b_strides, x, info, n, r, begin, end);
}

void cholesky_factor_solve_batch(const double* a, BatchStrides a_strides, const double* b, BatchStrides b_strides,
                                 double* x, int32_t* info, int64_t n, int64_t r, int64_t begin, int64_t end) {
  factor_solve_dispatch(a, a_strides, b, b_strides, x, info, n, r, begin, end);
}

}  // namespace attn_ext::cpu
