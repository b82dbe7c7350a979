// Per-matrix kernels of the batched Cholesky (see cholesky_simd.cpp for the method): the
// factorisation into U = Lᵀ, the copies in and out of the padded scratch layouts, and the two
// substitutions. Internal to cholesky_simd.cpp, which instantiates them once per instruction set;
// a header only so that the batch loops and the per-matrix arithmetic live in files of their own.
#pragma once

#include <cstdint>

#include "cholesky_blocks.h"
#include "cholesky_simd.h"
#include "simd_vector.h"

namespace attn_ext::cpu::cholesky {

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

/// L ← tril(Uᵀ): the first n columns of n rows with row stride ld_l (n for a contiguous output).
template <typename T, typename I>
ATTN_EXT_ALWAYS_INLINE void store_lower_transposed(const T* u, int64_t ld, T* l, int64_t n, int64_t ld_l) {
  constexpr int VB = I::kVectorBytes;
  constexpr int64_t W = kLanes<T, I>;
  const int64_t tiles = n / W;
  for (int64_t ti = 0; ti < tiles; ++ti) {
    T* l_rows = l + ti * W * ld_l;
    for (int64_t tj = 0; tj < ti; ++tj) {
      simd::transpose_tile<T, VB, simd::Keep::kAll>(u + tj * W * ld + ti * W, ld, l_rows + tj * W, ld_l);
    }
    simd::transpose_tile<T, VB, simd::Keep::kLower>(u + ti * W * ld + ti * W, ld, l_rows + ti * W, ld_l);
    for (int64_t t = 0; t < W; ++t) simd::zero_row<T, VB>(l_rows + t * ld_l + (ti + 1) * W, n - (ti + 1) * W);
  }
  for (int64_t i = tiles * W; i < n; ++i) {
    T* out = l + i * ld_l;
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

/// Factors A into U = Lᵀ (row stride round_up(n, W), `rows` rows) and returns info; on failure the
/// rows of U from the failed pivot on are zero.
template <typename T, typename I>
ATTN_EXT_ALWAYS_INLINE int32_t factor_matrix_in_place(const T* a, const BatchStrides& s, int64_t n, T* u,
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
  return info;
}

template <typename T, typename I>
ATTN_EXT_ALWAYS_INLINE int32_t factor_matrix(const T* a, const BatchStrides& s, T* l, int64_t n, T* u,
                                             NextMatrix& next) {
  const int32_t info = factor_matrix_in_place<T, I>(a, s, n, u, next);
  store_lower_transposed<T, I>(u, round_up(n, kLanes<T, I>), l, n, n);
  return info;
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

/// Copies L's lower triangle into the scratch's padded L and sets 1/L_ii.
template <typename T, typename I>
ATTN_EXT_ALWAYS_INLINE void load_factor(const T* l, const BatchStrides& ls, int64_t n, const SolveScratch<T, I>& w) {
  constexpr int VB = I::kVectorBytes;
  constexpr int64_t W = kLanes<T, I>;
  const int64_t ld_l = w.ld_l, rows = w.rows;
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
}

/// X = (L Lᵀ)⁻¹ B with L (and 1/L_ii) already in the scratch.
template <typename T, typename I>
ATTN_EXT_ALWAYS_INLINE void substitute(const T* b, const BatchStrides& bs, T* x, int64_t n, int64_t r,
                                       const SolveScratch<T, I>& w, NextMatrix& next) {
  constexpr int VB = I::kVectorBytes;
  constexpr int64_t W = kLanes<T, I>;
  const int64_t ld_y = w.ld_y, ld_l = w.ld_l, rows = w.rows;
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
ATTN_EXT_ALWAYS_INLINE void solve_matrix(const T* l, const BatchStrides& ls, const T* b, const BatchStrides& bs,
                                         T* x, int64_t n, int64_t r, const SolveScratch<T, I>& w, NextMatrix& next) {
  load_factor<T, I>(l, ls, n, w);
  substitute<T, I>(b, bs, x, n, r, w, next);
}

}  // namespace attn_ext::cpu::cholesky
