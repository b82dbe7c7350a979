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

#include <cstdlib>
#include <cstring>
#include <vector>

#include "cholesky_blocks.h"
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

/// U ← tril(A)ᵀ (row j of U holds column j of A's lower triangle from the diagonal on), zeros
/// elsewhere: in the strictly lower part and in the padding rows and columns, which thus compute to 0.
template <typename T, typename I>
ATTN_EXT_ALWAYS_INLINE void load_lower_transposed(const T* a, int64_t row_stride, int64_t col_stride, T* u,
                                                  int64_t ld, int64_t rows, int64_t n) {
  constexpr int VB = I::kVectorBytes;
  constexpr int64_t W = kLanes<T, I>;
  simd::zero_row<T, VB>(u, rows * ld);
  if (row_stride == 1) {  // A column-major: its columns are U's rows already
    for (int64_t j = 0; j < n; ++j) simd::copy_row<T, VB>(u + j * ld + j, a + j * col_stride + j, n - j);
    return;
  }
  const int64_t tiles = col_stride == 1 ? n / W : 0;
  for (int64_t ti = 0; ti < tiles; ++ti) {
    const T* a_rows = a + ti * W * row_stride;
    for (int64_t tj = 0; tj < ti; ++tj) {
      simd::transpose_tile<T, VB, simd::Keep::kAll>(a_rows + tj * W, row_stride, u + tj * W * ld + ti * W, ld);
    }
    simd::transpose_tile<T, VB, simd::Keep::kUpper>(a_rows + ti * W, row_stride, u + ti * W * ld + ti * W, ld);
  }
  // Rows of A below the whole tiles, row by row so that A streams in order.
  for (int64_t i = tiles * W; i < n; ++i) {
    const T* in = a + i * row_stride;
    for (int64_t j = 0; j <= i; ++j) u[j * ld + i] = in[j * col_stride];
  }
}

/// L ← tril(Uᵀ), n×n contiguous.
template <typename T, typename I>
ATTN_EXT_ALWAYS_INLINE void store_lower_transposed(const T* u, int64_t ld, T* l, int64_t n) {
  constexpr int VB = I::kVectorBytes;
  constexpr int64_t W = kLanes<T, I>;
  const int64_t tiles = n / W;
  for (int64_t ti = 0; ti < tiles; ++ti) {
    T* l_rows = l + ti * W * n;
    for (int64_t tj = 0; tj < ti; ++tj) {
      simd::transpose_tile<T, VB, simd::Keep::kAll>(u + tj * W * ld + ti * W, ld, l_rows + tj * W, n);
    }
    simd::transpose_tile<T, VB, simd::Keep::kLower>(u + ti * W * ld + ti * W, ld, l_rows + ti * W, n);
    for (int64_t t = 0; t < W; ++t) simd::zero_row<T, VB>(l_rows + t * n + (ti + 1) * W, n - (ti + 1) * W);
  }
  for (int64_t i = tiles * W; i < n; ++i) {
    T* out = l + i * n;
    for (int64_t j = 0; j <= i; ++j) out[j] = u[j * ld + i];
    simd::zero_row<T, VB>(out + i + 1, n - i - 1);
  }
}

/// The next matrix's input and output, fetched a slice per block of the current one.
struct NextMatrix {
  simd::Prefetch input, second_input, output;
  ATTN_EXT_ALWAYS_INLINE void step() {
    input.step();
    second_input.step();
    output.step();
  }
};

template <typename T, typename I>
ATTN_EXT_ALWAYS_INLINE int32_t factor_matrix(const T* a, const BatchStrides& s, T* l, int64_t n, T* u,
                                             NextMatrix& next) {
  constexpr int64_t W = kLanes<T, I>;
  const int64_t ld = round_up(n, W), rows = round_up(n, kBlockRows);
  load_lower_transposed<T, I>(a, s.row, s.col, u, ld, rows, n);
  int32_t info = 0;
  for (int64_t i0 = 0; i0 < n && info == 0; i0 += kBlockRows) {
    next.step();
    // The panels start at a whole vector: the lanes left of the block's diagonal are throwaway.
    const int64_t column_begin = i0 / W * W;
    T inv_diag[kBlockRows] = {};
    // coef(rr, p) = U[p][i0 + rr]. For a padding row (i0 + rr ≥ n) that may run past the end of
    // U's row p into the start of row p + 1: a value of the buffer that reaches only padding rows.
    BlockArgs<T> args{u + i0 * ld, u, ld, 0, i0, u + i0, 1, ld, i0, inv_diag};
    args.real_rows = static_cast<int>(n - i0 < kBlockRows ? n - i0 : kBlockRows);
    args.inv_diag_out = inv_diag;
    info = update_rows<T, I, Finish::kFactor, Finish::kForward>(column_begin, args);
  }
  if (info != 0) simd::zero_row<T, I::kVectorBytes>(u + (info - 1) * ld, (n - (info - 1)) * ld);
  store_lower_transposed<T, I>(u, ld, l, n);
  return info;
}

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

/// Scratch of the solve: Y (rows padded to whole blocks, columns to whole vectors), a copy of L's
/// lower triangle whose padding rows are zero (so padding rows of Y solve to 0 and add nothing),
/// and 1/L_ii (0 for padding rows).
template <typename T, typename I>
struct SolveScratch {
  int64_t rows, ld_y, ld_l;
  T* y;
  T* l;
  T* inv_diag;

  SolveScratch(int64_t n, int64_t r, T* base)
      : rows(round_up(n, kBlockRows)),
        ld_y(round_up(r, kLanes<T, I>)),
        ld_l(round_up(rows, kLanes<T, I>)),
        y(base),
        l(base + rows * ld_y),
        inv_diag(l + rows * ld_l) {}

  int64_t elements() const { return rows * (ld_y + ld_l) + rows; }
};

template <typename T, typename I>
ATTN_EXT_ALWAYS_INLINE void solve_matrix(const T* l, const BatchStrides& ls, const T* b, const BatchStrides& bs,
                                         T* x, int64_t n, int64_t r, const SolveScratch<T, I>& w, NextMatrix& next) {
  constexpr int VB = I::kVectorBytes;
  constexpr int64_t W = kLanes<T, I>;
  const int64_t ld_y = w.ld_y, ld_l = w.ld_l, rows = w.rows;
  for (int64_t i = 0; i < n; ++i) {
    const T* in = l + i * ls.row;
    T* row = w.l + i * ld_l;
    if (ls.col == 1) {
      // Whole vectors as far as the row goes: the upper-triangle entries copied along are never read.
      const int64_t whole = round_up(i + 1, W);
      simd::copy_row<T, VB>(row, in, whole < n ? whole : n);
    } else {
      for (int64_t k = 0; k <= i; ++k) row[k] = in[k * ls.col];
    }
    w.inv_diag[i] = T(1) / row[i];
  }
  simd::zero_row<T, VB>(w.l + n * ld_l, (rows - n) * ld_l);
  for (int64_t i = n; i < rows; ++i) w.inv_diag[i] = T(0);
  // With whole-vector rows, the first pass reads B and the last one writes X directly; otherwise
  // B is copied into the padded Y first and X out of it last.
  const bool direct = r % W == 0 && bs.col == 1;
  if (!direct) {
    for (int64_t i = 0; i < n; ++i) {
      T* row = w.y + i * ld_y;
      const T* in = b + i * bs.row;
      if (bs.col == 1) {
        simd::copy_row<T, VB>(row, in, r);
      } else {
        for (int64_t c = 0; c < r; ++c) row[c] = in[c * bs.col];
      }
      simd::zero_row<T, VB>(row + r, ld_y - r);
    }
    simd::zero_row<T, VB>(w.y + n * ld_y, (rows - n) * ld_y);
  }
  // L Y = B, blocks from the top: coef(rr, p) = L[i0 + rr][p].
  for (int64_t i0 = 0; i0 < rows; i0 += kBlockRows) {
    next.step();
    BlockArgs<T> args{w.y + i0 * ld_y, w.y, ld_y, 0, i0, w.l + i0 * ld_l, ld_l, 1, i0, w.inv_diag + i0};
    if (direct) {
      args.real_rows = static_cast<int>(n - i0 < kBlockRows ? n - i0 : kBlockRows);
      args.init = b + i0 * bs.row;
      args.init_ld = bs.row;
    }
    update_rows<T, I, Finish::kForward, Finish::kForward>(0, args);
  }
  // Lᵀ X = Y, blocks from the bottom: coef(rr, p) = L[p][i0 + rr]. Directly, the finished rows are
  // X's (ld_y = r), which has no padding rows: they are zero and add nothing, so p stops at n.
  for (int64_t i0 = rows - kBlockRows; i0 >= 0; i0 -= kBlockRows) {
    next.step();
    BlockArgs<T> args{w.y + i0 * ld_y, w.y, ld_y, i0 + kBlockRows, rows, w.l + i0, 1, ld_l, i0, w.inv_diag + i0};
    if (direct) {
      args.src = x;
      args.p_end = n;
      args.real_rows = static_cast<int>(n - i0 < kBlockRows ? n - i0 : kBlockRows);
      args.out = x + i0 * r;
    }
    update_rows<T, I, Finish::kBackward, Finish::kBackward>(0, args);
  }
  if (!direct) {
    for (int64_t i = 0; i < n; ++i) simd::copy_row<T, VB>(x + i * r, w.y + i * ld_y, r);
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

// One compiled copy of the kernels per instruction set, each with the vector and panel widths that
// fit its registers (target_clones would compile one configuration for all three), chosen per call.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ATTN_EXT_TARGET(arch) __attribute__((target(arch)))
#define ATTN_EXT_X86_KERNELS 1
#else
#define ATTN_EXT_TARGET(arch)
#endif

#define ATTN_EXT_CHOLESKY_KERNELS(T, name, target, I)                                                    \
  target void factor_##name(const T* a, BatchStrides s, T* l, int32_t* info, int64_t n, int64_t begin,  \
                            int64_t end) {                                                              \
    factor_batch<T, I>(a, s, l, info, n, begin, end);                                                   \
  }                                                                                                     \
  target void solve_##name(const T* l, BatchStrides ls, const T* b, BatchStrides bs, T* x, int64_t n,   \
                           int64_t r, int64_t begin, int64_t end) {                                     \
    solve_batch<T, I>(l, ls, b, bs, x, n, r, begin, end);                                               \
  }

ATTN_EXT_CHOLESKY_KERNELS(float, baseline, , Baseline)
ATTN_EXT_CHOLESKY_KERNELS(double, baseline, , Baseline)
#ifdef ATTN_EXT_X86_KERNELS
ATTN_EXT_CHOLESKY_KERNELS(float, avx2, ATTN_EXT_TARGET("arch=x86-64-v3"), Avx2)
ATTN_EXT_CHOLESKY_KERNELS(double, avx2, ATTN_EXT_TARGET("arch=x86-64-v3"), Avx2)
ATTN_EXT_CHOLESKY_KERNELS(float, avx512, ATTN_EXT_TARGET("arch=x86-64-v4"), Avx512)
ATTN_EXT_CHOLESKY_KERNELS(double, avx512, ATTN_EXT_TARGET("arch=x86-64-v4"), Avx512)
#endif

enum class IsaLevel { kBaseline, kAvx2, kAvx512 };

/// The best level this CPU runs, capped by ATTN_EXT_CPU_ISA=avx2|baseline if set (read on each call,
/// so that tests can run every path on one machine).
IsaLevel isa_level() {
#ifdef ATTN_EXT_X86_KERNELS
  static const IsaLevel cpu = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("x86-64-v4")   ? IsaLevel::kAvx512
           : __builtin_cpu_supports("x86-64-v3") ? IsaLevel::kAvx2
                                                 : IsaLevel::kBaseline;
  }();
  const char* cap = std::getenv("ATTN_EXT_CPU_ISA");
  if (cap != nullptr && std::strcmp(cap, "baseline") == 0) return IsaLevel::kBaseline;
  if (cap != nullptr && std::strcmp(cap, "avx2") == 0 && cpu == IsaLevel::kAvx512) return IsaLevel::kAvx2;
  return cpu;
#else
  return IsaLevel::kBaseline;
#endif
}

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

}  // namespace attn_ext::cpu
