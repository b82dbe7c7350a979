// Register-blocked Cholesky factorisation and solves of small SPD matrices (see cholesky_simd.h).
//
// Both are row-oriented substitutions whose inner loops run over contiguous rows:
//  * the solve keeps Y (n×r) row-major, so y_i = (b_i − Σ_{k<i} L_ik y_k) / L_ii updates all r
//    right-hand sides of row i with one broadcast coefficient per finished row k (and the back
//    substitution likewise from the bottom, with L_ki);
//  * the factorisation works on U = Lᵀ stored row-major (L column-major), whose row i over the
//    columns ≥ i is u_i = (a_i − Σ_{k<i} U_ki u_k) / U_ii with U_ii² the pivot: the same
//    substitution (left-looking, Crout order), the rows of U playing the part of Y's rows.
// The micro-kernel updates R = 6 rows × up to 4 vectors (64 floats or 32 doubles), so that its 24
// accumulators stay in AVX-512 registers over the whole k loop and each k costs 4 vector loads and 6
// broadcasts for 24 FMAs. Rows are padded to whole blocks and whole vectors in a scratch buffer (the
// padding rows compute zeros and are dropped), which also frees the kernels from the input strides.
// Reading A's lower triangle into U and writing L = Uᵀ out are in-register tile transposes.
#include "cholesky_simd.h"

#include <cmath>
#include <limits>
#include <vector>

#include "simd_vector.h"

// The block sizes suit AVX-512's 32 registers.
#include "cpu_clones.h"

namespace attn_ext::cpu {
namespace {

using simd::kLanes;
using simd::round_up;

constexpr int kBlockRows = 6;
constexpr int kPanelVectors = 4;

/// How a block of rows is completed once the contributions of the rows outside it are subtracted:
///  * kForward (kBackward): each row rr subtracts coef(rr, first + q) · row q of the block's rows
///    q < rr (q > rr), in that order, and is scaled by inv_diag[rr];
///  * kFactor, the Cholesky step on the panel holding the block's diagonal: row rr subtracts
///    U[first + q][first + rr] · row q (q < rr); its pivot, the entry U[first + rr][first + rr], must
///    be positive and finite; the row is divided by the pivot's square root, which replaces the
///    pivot, and 1/√pivot goes to inv_diag_out[rr] (for the other panels: kForward with coef = U).
enum class Finish { kForward, kBackward, kFactor };

/// One block of rows of a substitution: rows[rr] (rr < kBlockRows, stride ld, from the panel's first
/// column) become rows[rr] − Σ_{p ∈ [p_begin, p_end)} coef(rr, p) · src[p], where coef(rr, p) =
/// coef[rr·coef_rr + p·coef_p] and src[p] are finished rows (stride ld); then Finish.
template <typename T>
struct BlockArgs {
  T* rows;
  const T* src;
  int64_t ld, p_begin, p_end;
  const T* coef;
  int64_t coef_rr, coef_p, first;
  const T* inv_diag;
  int real_rows = kBlockRows;  // the block's rows that are not padding
  // Optional: read the rows' initial values from `init` (stride init_ld; padding rows start at 0)
  // and write the real rows to `out` (stride ld) instead of `rows`, which saves copy passes.
  const T* init = nullptr;
  int64_t init_ld = 0;
  T* out = nullptr;
  // kFactor only: the panel column of U[first][first], where 1/√pivot goes.
  int64_t diag_column = 0;
  T* inv_diag_out = nullptr;
};

/// Returns 0, or for kFactor the LAPACK info (first + rr + 1) of a bad pivot; the block's rows from
/// that one on are then left unfinished.
template <typename T, int NV, Finish kFinish>
ATTN_EXT_ALWAYS_INLINE int32_t update_block(const BlockArgs<T>& args) {
  using V = typename simd::Vector<T>::type;
  constexpr int R = kBlockRows;
  constexpr int64_t W = kLanes<T>;
  const int64_t ld = args.ld, coef_rr = args.coef_rr, coef_p = args.coef_p;
  V acc[R][NV];
#pragma GCC unroll 8
  for (int rr = 0; rr < R; ++rr) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      acc[rr][v] = args.init == nullptr        ? simd::load(args.rows + rr * ld + v * W)
                   : rr < args.real_rows ? simd::load(args.init + rr * args.init_ld + v * W)
                                         : V{};
    }
  }
  const T* src = args.src + args.p_begin * ld;
  const T* coef = args.coef + args.p_begin * coef_p;
  for (int64_t p = args.p_begin; p < args.p_end; ++p, src += ld, coef += coef_p) {
    V s[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) s[v] = simd::load(src + v * W);
#pragma GCC unroll 8
    for (int rr = 0; rr < R; ++rr) {
      const T c = coef[rr * coef_rr];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[rr][v] -= c * s[v];
    }
  }
  int32_t info = 0;
  if constexpr (kFinish == Finish::kFactor) {
    // The diagonal lies in the panel's first two vectors (the panel starts at most W − 1 columns
    // left of it); a copy of them is where single entries (pivots, coefficients) are read back from.
    constexpr int kHead = NV < 2 ? NV : 2;
    alignas(64) T head[R][kHead * W];
#pragma GCC unroll 8
    for (int rr = 0; rr < R; ++rr) {
      if (rr >= args.real_rows || info != 0) continue;
      const int64_t d = args.diag_column + rr;
#pragma GCC unroll 8
      for (int q = 0; q < rr; ++q) {
        const T c = head[q][d];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[rr][v] -= c * acc[q][v];
      }
#pragma GCC unroll 2
      for (int v = 0; v < kHead; ++v) simd::store(head[rr] + v * W, acc[rr][v]);
      const T pivot = head[rr][d];
      if (!(pivot > T(0) && pivot <= std::numeric_limits<T>::max())) {
        info = static_cast<int32_t>(args.first + rr + 1);
        continue;
      }
      const T diag = std::sqrt(pivot);
      const T inv_diag = T(1) / diag;
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[rr][v] *= inv_diag;
      // The exact square root on the diagonal; left of it the lanes computed throwaway values, and
      // zeroing them keeps what later blocks compute from them of the input's magnitude.
#pragma GCC unroll 2
      for (int v = 0; v < kHead; ++v) {
        const V with_diag = simd::select<T>(simd::lane_at<T>(d - v * W), V{} + diag, acc[rr][v]);
        acc[rr][v] = simd::select<T>(simd::lanes_before<T>(d - v * W), V{}, with_diag);
        simd::store(head[rr] + v * W, acc[rr][v]);
      }
      args.inv_diag_out[rr] = inv_diag;
    }
  } else {
    const T* diag_coef = args.coef + args.first * coef_p;
#pragma GCC unroll 8
    for (int step = 0; step < R; ++step) {
      const int rr = kFinish == Finish::kForward ? step : R - 1 - step;
      const int q_begin = kFinish == Finish::kForward ? 0 : rr + 1;
      const int q_end = kFinish == Finish::kForward ? rr : R;
#pragma GCC unroll 8
      for (int q = q_begin; q < q_end; ++q) {
        const T c = diag_coef[rr * coef_rr + q * coef_p];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[rr][v] -= c * acc[q][v];
      }
      const T scale = args.inv_diag[rr];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[rr][v] *= scale;
    }
  }
#pragma GCC unroll 8
  for (int rr = 0; rr < R; ++rr) {
    if (args.out != nullptr && rr >= args.real_rows) continue;
    T* out = (args.out != nullptr ? args.out : args.rows) + rr * ld;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) simd::store(out + v * W, acc[rr][v]);
  }
  return info;
}

template <typename T, Finish kFinish>
ATTN_EXT_ALWAYS_INLINE int32_t update_panel(int vectors, const BlockArgs<T>& panel) {
  switch (vectors) {
    case 1: return update_block<T, 1, kFinish>(panel);
    case 2: return update_block<T, 2, kFinish>(panel);
    case 3: return update_block<T, 3, kFinish>(panel);
    default: return update_block<T, 4, kFinish>(panel);
  }
}

/// The block's rows over the columns [column_begin, ld), in panels of up to kPanelVectors vectors,
/// the first one with kFirst and the others with kRest. `args.rows` and `args.src` point at column 0.
template <typename T, Finish kFirst, Finish kRest>
ATTN_EXT_ALWAYS_INLINE int32_t update_rows(int64_t column_begin, const BlockArgs<T>& args) {
  constexpr int64_t W = kLanes<T>;
  for (int64_t c = column_begin; c < args.ld; c += kPanelVectors * W) {
    BlockArgs<T> panel = args;
    panel.rows += c;
    panel.src += c;
    if (panel.init != nullptr) panel.init += c;
    if (panel.out != nullptr) panel.out += c;
    panel.diag_column = args.first - c;
    const int vectors = static_cast<int>((args.ld - c) / W);
    const int32_t info = c == column_begin ? update_panel<T, kFirst>(vectors, panel)
                                           : update_panel<T, kRest>(vectors, panel);
    if (info != 0) return info;
  }
  return 0;
}

/// U ← tril(A)ᵀ (row j of U holds column j of A's lower triangle from the diagonal on), zeros
/// elsewhere: in the strictly lower part and in the padding rows and columns, which thus compute to 0.
template <typename T>
ATTN_EXT_ALWAYS_INLINE void load_lower_transposed(const T* a, int64_t row_stride, int64_t col_stride, T* u,
                                                  int64_t ld, int64_t rows, int64_t n) {
  constexpr int64_t W = kLanes<T>;
  simd::zero_row(u, rows * ld);
  if (row_stride == 1) {  // A column-major: its columns are U's rows already
    for (int64_t j = 0; j < n; ++j) simd::copy_row(u + j * ld + j, a + j * col_stride + j, n - j);
    return;
  }
  const int64_t tiles = col_stride == 1 ? n / W : 0;
  for (int64_t ti = 0; ti < tiles; ++ti) {
    const T* a_rows = a + ti * W * row_stride;
    for (int64_t tj = 0; tj < ti; ++tj) {
      simd::transpose_tile<T, simd::Keep::kAll>(a_rows + tj * W, row_stride, u + tj * W * ld + ti * W, ld);
    }
    simd::transpose_tile<T, simd::Keep::kUpper>(a_rows + ti * W, row_stride, u + ti * W * ld + ti * W, ld);
  }
  // Rows of A below the whole tiles, row by row so that A streams in order.
  for (int64_t i = tiles * W; i < n; ++i) {
    const T* in = a + i * row_stride;
    for (int64_t j = 0; j <= i; ++j) u[j * ld + i] = in[j * col_stride];
  }
}

/// L ← tril(Uᵀ), n×n contiguous.
template <typename T>
ATTN_EXT_ALWAYS_INLINE void store_lower_transposed(const T* u, int64_t ld, T* l, int64_t n) {
  constexpr int64_t W = kLanes<T>;
  const int64_t tiles = n / W;
  for (int64_t ti = 0; ti < tiles; ++ti) {
    T* l_rows = l + ti * W * n;
    for (int64_t tj = 0; tj < ti; ++tj) {
      simd::transpose_tile<T, simd::Keep::kAll>(u + tj * W * ld + ti * W, ld, l_rows + tj * W, n);
    }
    simd::transpose_tile<T, simd::Keep::kLower>(u + ti * W * ld + ti * W, ld, l_rows + ti * W, n);
    for (int64_t t = 0; t < W; ++t) simd::zero_row(l_rows + t * n + (ti + 1) * W, n - (ti + 1) * W);
  }
  for (int64_t i = tiles * W; i < n; ++i) {
    T* out = l + i * n;
    for (int64_t j = 0; j <= i; ++j) out[j] = u[j * ld + i];
    simd::zero_row(out + i + 1, n - i - 1);
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

template <typename T>
ATTN_EXT_ALWAYS_INLINE int32_t factor_matrix(const T* a, const BatchStrides& s, T* l, int64_t n, T* u,
                                             NextMatrix& next) {
  constexpr int64_t W = kLanes<T>;
  const int64_t ld = round_up(n, W), rows = round_up(n, kBlockRows);
  load_lower_transposed(a, s.row, s.col, u, ld, rows, n);
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
    info = update_rows<T, Finish::kFactor, Finish::kForward>(column_begin, args);
  }
  if (info != 0) simd::zero_row(u + (info - 1) * ld, (n - (info - 1)) * ld);
  store_lower_transposed(u, ld, l, n);
  return info;
}

template <typename T>
ATTN_EXT_ALWAYS_INLINE void factor_batch(const T* a, const BatchStrides& s, T* l, int32_t* info, int64_t n,
                                         int64_t begin, int64_t end) {
  const int64_t ld = round_up(n, kLanes<T>), rows = round_up(n, kBlockRows);
  std::vector<T> storage(rows * ld + kLanes<T>);
  T* u = reinterpret_cast<T*>(round_up(reinterpret_cast<intptr_t>(storage.data()), 64));
  const int64_t blocks = rows / kBlockRows;
  for (int64_t m = begin; m < end; ++m) {
    NextMatrix next;
    if (m + 1 < end) {
      next.input = simd::Prefetch::span(a + (m + 1) * s.batch, n, n, s.row, s.col, blocks);
      next.output = simd::Prefetch::span(l + (m + 1) * n * n, n, n, n, 1, blocks, true);
    }
    info[m] = factor_matrix(a + m * s.batch, s, l + m * n * n, n, u, next);
  }
}

/// Scratch of the solve: Y (rows padded to whole blocks, columns to whole vectors), a copy of L's
/// lower triangle whose padding rows are zero (so padding rows of Y solve to 0 and add nothing),
/// and 1/L_ii (0 for padding rows).
template <typename T>
struct SolveScratch {
  int64_t rows, ld_y, ld_l;
  T* y;
  T* l;
  T* inv_diag;

  SolveScratch(int64_t n, int64_t r, T* base)
      : rows(round_up(n, kBlockRows)),
        ld_y(round_up(r, kLanes<T>)),
        ld_l(round_up(rows, kLanes<T>)),
        y(base),
        l(base + rows * ld_y),
        inv_diag(l + rows * ld_l) {}

  int64_t elements() const { return rows * (ld_y + ld_l) + rows; }
};

template <typename T>
ATTN_EXT_ALWAYS_INLINE void solve_matrix(const T* l, const BatchStrides& ls, const T* b, const BatchStrides& bs,
                                         T* x, int64_t n, int64_t r, const SolveScratch<T>& w, NextMatrix& next) {
  constexpr int64_t W = kLanes<T>;
  const int64_t ld_y = w.ld_y, ld_l = w.ld_l, rows = w.rows;
  for (int64_t i = 0; i < n; ++i) {
    const T* in = l + i * ls.row;
    T* row = w.l + i * ld_l;
    if (ls.col == 1) {
      // Whole vectors as far as the row goes: the upper-triangle entries copied along are never read.
      const int64_t whole = round_up(i + 1, W);
      simd::copy_row(row, in, whole < n ? whole : n);
    } else {
      for (int64_t k = 0; k <= i; ++k) row[k] = in[k * ls.col];
    }
    w.inv_diag[i] = T(1) / row[i];
  }
  simd::zero_row(w.l + n * ld_l, (rows - n) * ld_l);
  for (int64_t i = n; i < rows; ++i) w.inv_diag[i] = T(0);
  // With whole-vector rows, the first pass reads B and the last one writes X directly; otherwise
  // B is copied into the padded Y first and X out of it last.
  const bool direct = r % W == 0 && bs.col == 1;
  if (!direct) {
    for (int64_t i = 0; i < n; ++i) {
      T* row = w.y + i * ld_y;
      const T* in = b + i * bs.row;
      if (bs.col == 1) {
        simd::copy_row(row, in, r);
      } else {
        for (int64_t c = 0; c < r; ++c) row[c] = in[c * bs.col];
      }
      simd::zero_row(row + r, ld_y - r);
    }
    simd::zero_row(w.y + n * ld_y, (rows - n) * ld_y);
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
    update_rows<T, Finish::kForward, Finish::kForward>(0, args);
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
    update_rows<T, Finish::kBackward, Finish::kBackward>(0, args);
  }
  if (!direct) {
    for (int64_t i = 0; i < n; ++i) simd::copy_row(x + i * r, w.y + i * ld_y, r);
  }
}

template <typename T>
ATTN_EXT_ALWAYS_INLINE void solve_batch(const T* l, const BatchStrides& ls, const T* b, const BatchStrides& bs, T* x,
                                        int64_t n, int64_t r, int64_t begin, int64_t end) {
  std::vector<T> storage(SolveScratch<T>(n, r, nullptr).elements() + kLanes<T>);
  const SolveScratch<T> scratch(n, r, reinterpret_cast<T*>(round_up(reinterpret_cast<intptr_t>(storage.data()), 64)));
  const int64_t steps = 2 * scratch.rows / kBlockRows;  // blocks of the forward and the back substitution
  for (int64_t m = begin; m < end; ++m) {
    NextMatrix next;
    if (m + 1 < end) {
      next.input = simd::Prefetch::span(l + (m + 1) * ls.batch, n, n, ls.row, ls.col, steps);
      next.second_input = simd::Prefetch::span(b + (m + 1) * bs.batch, n, r, bs.row, bs.col, steps);
      next.output = simd::Prefetch::span(x + (m + 1) * n * r, n, r, r, 1, steps, true);
    }
    solve_matrix(l + m * ls.batch, ls, b + m * bs.batch, bs, x + m * n * r, n, r, scratch, next);
  }
}

}  // namespace

ATTN_EXT_CPU_CLONES void cholesky_factor_batch(const float* a, BatchStrides a_strides, float* l, int32_t* info,
                                               int64_t n, int64_t begin, int64_t end) {
  factor_batch(a, a_strides, l, info, n, begin, end);
}

ATTN_EXT_CPU_CLONES void cholesky_factor_batch(const double* a, BatchStrides a_strides, double* l, int32_t* info,
                                               int64_t n, int64_t begin, int64_t end) {
  factor_batch(a, a_strides, l, info, n, begin, end);
}

ATTN_EXT_CPU_CLONES void cholesky_solve_batch(const float* l, BatchStrides l_strides, const float* b,
                                              BatchStrides b_strides, float* x, int64_t n, int64_t r, int64_t begin,
                                              int64_t end) {
  solve_batch(l, l_strides, b, b_strides, x, n, r, begin, end);
}

ATTN_EXT_CPU_CLONES void cholesky_solve_batch(const double* l, BatchStrides l_strides, const double* b,
                                              BatchStrides b_strides, double* x, int64_t n, int64_t r,
                                              int64_t begin, int64_t end) {
  solve_batch(l, l_strides, b, b_strides, x, n, r, begin, end);
}

}  // namespace attn_ext::cpu
