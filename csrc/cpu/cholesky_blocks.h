// The micro-kernel of the batched Cholesky kernels (cholesky_simd.cpp): one block of 6 rows of a
// row-oriented substitution, over a panel of vectors, accumulated in registers, with the per-ISA
// vector and panel widths. Internal: include only from cholesky_simd.cpp (see simd_vector.h on
// inlining).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "simd_vector.h"

namespace attn_ext::cpu::cholesky {

constexpr int kBlockRows = 6;

/// Vector width and panel width (in vectors) per instruction set: 6 × 4 accumulators fit AVX-512's
/// 32 registers, 6 × 2 the 16 of AVX2 and SSE2.
struct Avx512 {
  static constexpr int kVectorBytes = 64, kPanelVectors = 4;
};
struct Avx2 {
  static constexpr int kVectorBytes = 32, kPanelVectors = 2;
};
struct Baseline {
  static constexpr int kVectorBytes = 16, kPanelVectors = 2;
};

template <typename T, typename I>
constexpr int64_t kLanes = simd::kLanes<T, I::kVectorBytes>;

/// Vectors from the first one of a factorisation panel (which starts at most W − 1 columns left of
/// the block's diagonal) to the last diagonal entry of the block: they must all be in that panel.
template <typename T, typename I>
constexpr int kDiagonalVectors = static_cast<int>((kLanes<T, I> - 1 + kBlockRows + kLanes<T, I> - 1) / kLanes<T, I>);

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
template <typename T, typename I, int NV, Finish kFinish>
ATTN_EXT_ALWAYS_INLINE int32_t update_block(const BlockArgs<T>& args) {
  constexpr int VB = I::kVectorBytes;
  using V = typename simd::Vector<T, VB>::type;
  constexpr int R = kBlockRows;
  constexpr int64_t W = kLanes<T, I>;
  const int64_t ld = args.ld, coef_rr = args.coef_rr, coef_p = args.coef_p;
  V acc[R][NV];
#pragma GCC unroll 8
  for (int rr = 0; rr < R; ++rr) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      acc[rr][v] = args.init == nullptr        ? simd::load<T, VB>(args.rows + rr * ld + v * W)
                   : rr < args.real_rows ? simd::load<T, VB>(args.init + rr * args.init_ld + v * W)
                                         : V{};
    }
  }
  const T* src = args.src + args.p_begin * ld;
  const T* coef = args.coef + args.p_begin * coef_p;
  for (int64_t p = args.p_begin; p < args.p_end; ++p, src += ld, coef += coef_p) {
    V s[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) s[v] = simd::load<T, VB>(src + v * W);
#pragma GCC unroll 8
    for (int rr = 0; rr < R; ++rr) {
      const T c = coef[rr * coef_rr];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[rr][v] -= c * s[v];
    }
  }
  int32_t info = 0;
  if constexpr (kFinish == Finish::kFactor) {
    // A copy of the vectors holding the block's diagonal, where single entries (pivots,
    // coefficients) are read back from.
    constexpr int kHead = NV < kDiagonalVectors<T, I> ? NV : kDiagonalVectors<T, I>;
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
      for (int v = 0; v < kHead; ++v) simd::store<T, VB>(head[rr] + v * W, acc[rr][v]);
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
        const V with_diag = simd::select<T, VB>(simd::lane_at<T, VB>(d - v * W), V{} + diag, acc[rr][v]);
        acc[rr][v] = simd::select<T, VB>(simd::lanes_before<T, VB>(d - v * W), V{}, with_diag);
        simd::store<T, VB>(head[rr] + v * W, acc[rr][v]);
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
    for (int v = 0; v < NV; ++v) simd::store<T, VB>(out + v * W, acc[rr][v]);
  }
  return info;
}

template <typename T, typename I, Finish kFinish>
ATTN_EXT_ALWAYS_INLINE int32_t update_panel(int vectors, const BlockArgs<T>& panel) {
  switch (vectors) {
    case 1: return update_block<T, I, 1, kFinish>(panel);
    case 2: return update_block<T, I, 2, kFinish>(panel);
    case 3: return update_block<T, I, 3, kFinish>(panel);
    default: return update_block<T, I, 4, kFinish>(panel);
  }
}

/// The block's rows over the columns [column_begin, ld), in panels of I::kPanelVectors vectors (the
/// first one wide enough for the block's diagonal), the first with kFirst and the others with kRest.
/// `args.rows` and `args.src` point at column 0.
template <typename T, typename I, Finish kFirst, Finish kRest>
ATTN_EXT_ALWAYS_INLINE int32_t update_rows(int64_t column_begin, const BlockArgs<T>& args) {
  constexpr int64_t W = kLanes<T, I>;
  constexpr int kFirstVectors = kFirst == Finish::kFactor && kDiagonalVectors<T, I> > I::kPanelVectors
                                    ? kDiagonalVectors<T, I>
                                    : I::kPanelVectors;
  static_assert(kFirstVectors <= 4, "update_panel handles panels of up to 4 vectors");
  for (int64_t c = column_begin; c < args.ld;) {
    BlockArgs<T> panel = args;
    panel.rows += c;
    panel.src += c;
    if (panel.init != nullptr) panel.init += c;
    if (panel.out != nullptr) panel.out += c;
    panel.diag_column = args.first - c;
    const int64_t remaining = (args.ld - c) / W;
    const int64_t wanted = c == column_begin ? kFirstVectors : I::kPanelVectors;
    const int vectors = static_cast<int>(remaining < wanted ? remaining : wanted);
    const int32_t info = c == column_begin ? update_panel<T, I, kFirst>(vectors, panel)
                                           : update_panel<T, I, kRest>(vectors, panel);
    if (info != 0) return info;
    c += vectors * W;
  }
  return 0;
}

}  // namespace attn_ext::cpu::cholesky
