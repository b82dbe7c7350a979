// The per-(batch, head) pieces of Intention's CPU kernels (docs/spec.md §4), shared by intention.cpp and
// sigma_intention.cpp: raw views of the inputs, the Gram statistics accumulated over valid keys,
// and the factor and weights W = (KᵀK + αI)⁻¹C they give.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>

#include "blas.h"
#include "cholesky_simd.h"
#include "checks/intention_checks.h"

namespace attn_ext::cpu::intention {

constexpr int64_t kRowChunk = 256;  // rows per BLAS call: big enough for BLAS, small enough for L2

/// Raw views of one call's inputs (last dims contiguous) and its sizes. Without values (C = I)
/// has_v is false; v's pointer does not say it, because an empty tensor (N = 0 keys, or Dv = 0)
/// has a null data pointer too.
template <typename scalar_t>
struct IntentionArgs {
  const scalar_t *q, *k, *v;
  bool has_v;
  const bool* mask;  // [B, N] or nullptr
  int64_t B, H, M, N, D, Dv;
  int64_t qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2;
};

/// Copies up to kRowChunk valid rows of k (and v) from `*next` on into `kbuf [rows, D]` / `vbuf
/// [rows, Dv]`, upcast; returns the number copied and their key indices in `rows_out`.
template <typename scalar_t, typename acc_t>
int64_t gather_valid_rows(const IntentionArgs<scalar_t>& a, int64_t b, int64_t h, int64_t* next, acc_t* kbuf,
                          acc_t* vbuf, int64_t* rows_out) {
  const bool* mask_row = a.mask ? a.mask + b * a.N : nullptr;
  int64_t count = 0;
  for (; *next < a.N && count < kRowChunk; ++*next) {
    const int64_t n = *next;
    if (mask_row && mask_row[n]) continue;
    const scalar_t* kr = a.k + b * a.ks0 + h * a.ks1 + n * a.ks2;
    for (int64_t d = 0; d < a.D; ++d) kbuf[count * a.D + d] = static_cast<acc_t>(kr[d]);
    if (a.has_v) {
      const scalar_t* vr = a.v + b * a.vs0 + h * a.vs1 + n * a.vs2;
      for (int64_t d = 0; d < a.Dv; ++d) vbuf[count * a.Dv + d] = static_cast<acc_t>(vr[d]);
    }
    rows_out[count++] = n;
  }
  return count;
}

template <typename scalar_t, typename acc_t>
void upcast_rows(const scalar_t* src, int64_t stride, int64_t rows, int64_t cols, acc_t* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = static_cast<acc_t>(src[r * stride + c]);
  }
}

/// Per-thread buffers of forward_head, allocated once per parallel range and left uninitialised
/// (a value-initialised std::vector would memset ~0.3 MB per (b, h), as much as the small GEMMs cost).
template <typename acc_t>
struct ForwardScratch {
  std::unique_ptr<acc_t[]> kbuf, vbuf, stats, qbuf, obuf;
  std::unique_ptr<int64_t[]> rows;
  ForwardScratch(int64_t D, int64_t Dv)
      : kbuf(new acc_t[kRowChunk * D]), vbuf(new acc_t[kRowChunk * Dv]),
        stats(new acc_t[D * (D + Dv)]), qbuf(new acc_t[kRowChunk * D]), obuf(new acc_t[kRowChunk * Dv]),
        rows(new int64_t[kRowChunk]) {}
};

// Rows of G per GEMM of gram_lower: G is symmetric and the Cholesky reads its lower triangle only,
// so row block i needs columns [0, (i+1)·kGramBlock) — 3/4 of KᵀK's flops at D = 64, 5/8 at 128.
// Narrower blocks save more flops but the GEMMs get too thin to run near peak.
constexpr int64_t kGramBlock = 32;

/// stats[:D, :D] (row stride E) ← beta·stats + KᵀK on and below the diagonal blocks (k: `rows` × D,
/// row stride ldk); the entries above are left as they were and must never be read.
template <typename acc_t>
void gram_lower(const acc_t* k, int64_t ldk, int64_t rows, int64_t D, acc_t beta, acc_t* stats, int64_t E) {
  for (int64_t r0 = 0; r0 < D; r0 += kGramBlock) {
    const int64_t r1 = std::min(D, r0 + kGramBlock);
    gemm(Transpose::kYes, Transpose::kNo, r1 - r0, r1, rows, acc_t(1), k + r0, ldk, k, ldk, beta, stats + r0 * E, E);
  }
}

/// Accumulates [G | C] (D × E, row stride E) of one (b, h) into `stats` (zeroed here); G only on
/// and below its diagonal blocks (see gram_lower). Returns the number of valid keys.
template <typename scalar_t, typename acc_t>
int64_t accumulate_statistics(const IntentionArgs<scalar_t>& a, int64_t b, int64_t h, ForwardScratch<acc_t>& w) {
  const int64_t D = a.D, Dv = a.Dv, E = D + Dv;
  acc_t* stats = w.stats.get();
  std::fill(stats, stats + D * E, acc_t(0));
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    // No padding, no upcast, BLAS-compatible row strides (not a broadcast): BLAS reads K and V in place.
    if (a.mask == nullptr && a.N > 0 && a.ks2 >= D && (!a.has_v || a.vs2 >= Dv)) {
      const scalar_t* k = a.k + b * a.ks0 + h * a.ks1;
      gram_lower(k, a.ks2, a.N, D, acc_t(0), stats, E);
      if (a.has_v) {
        gemm(Transpose::kYes, Transpose::kNo, D, Dv, a.N, acc_t(1), k, a.ks2, a.v + b * a.vs0 + h * a.vs1, a.vs2,
             acc_t(0), stats + D, E);
      }
      return a.N;
    }
  }
  int64_t next = 0, valid = 0;
  while (true) {
    const int64_t count = gather_valid_rows(a, b, h, &next, w.kbuf.get(), w.vbuf.get(), w.rows.get());
    if (count == 0) break;
    valid += count;
    gram_lower(w.kbuf.get(), D, count, D, acc_t(1), stats, E);
    if (a.has_v) {
      gemm(Transpose::kYes, Transpose::kNo, D, Dv, count, acc_t(1), w.kbuf.get(), D, w.vbuf.get(), Dv, acc_t(1),
           stats + D, E);
    }
  }
  return valid;
}

/// True if x[0..n) holds no NaN or ±inf. Branch-free so that the compiler vectorises it (float; the
/// baseline ISA has no 64-bit lane compare for double). It runs once per head over [G | C], never
/// per element of K.
template <typename acc_t>
inline bool all_finite(const acc_t* x, int64_t n) {
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= !(std::abs(x[i]) <= std::numeric_limits<acc_t>::max());
  return bad == 0;
}

/// Rows of `out` = scale·Q W (`rows` × cols, row stride ldo) whose query row (q, row stride ldq, D
/// entries) is not finite become NaN: a NaN query gives a NaN row by itself, but ±inf would give ±inf,
/// and the rule is NaN for any non-finite input a row depends on. With W finite, a non-finite query
/// always makes the row's first entry non-finite (±inf·w, or inf·0 = NaN), so a finite first entry
/// clears the row at the cost of one load; only the rare others have their query row read. BLAS may
/// skip Q altogether when scale = 0, so then every query row is read.
template <typename acc_t>
void nan_rows_of_nonfinite_queries(const acc_t* q, int64_t ldq, int64_t rows, int64_t D, acc_t scale, acc_t* out,
                                   int64_t ldo, int64_t cols) {
  if (cols == 0) return;
  for (int64_t m = 0; m < rows; ++m) {
    if ((scale != acc_t(0) && std::isfinite(out[m * ldo])) || all_finite(q + m * ldq, D)) continue;
    std::fill(out + m * ldo, out + m * ldo + cols, std::numeric_limits<acc_t>::quiet_NaN());
  }
}

/// Factor L of A = KᵀK + αI and W = A⁻¹C of one (b, h) (C = KᵀV, or I without values) into
/// `factor` [D, D] and `weights` [D, Dv]. Returns 0, a Cholesky info (A is finite but not positive
/// definite), kIntentionTooFewKeys (α = 0 with fewer than D valid keys: singular even where rounding
/// would let the factorisation through), or kIntentionNonFinite ([G | C] is not finite: a NaN/inf key
/// or value, or an overflow; factor and weights are then NaN, so the head's outputs and gradients are).
template <typename scalar_t, typename acc_t>
int solve_weights(const IntentionArgs<scalar_t>& a, int64_t b, int64_t h, acc_t alpha, acc_t* factor, acc_t* weights,
                  ForwardScratch<acc_t>& w) {
  const int64_t D = a.D, Dv = a.Dv, E = D + Dv;
  const int64_t valid = accumulate_statistics(a, b, h, w);
  acc_t* stats = w.stats.get();
  // One pass over [G | C] (entries above G's diagonal blocks are the zeros of the fill): cheaper than
  // testing K and V, and it also catches a Gram that overflowed.
  if (!all_finite(stats, D * E)) {
    std::fill(factor, factor + D * D, std::numeric_limits<acc_t>::quiet_NaN());
    std::fill(weights, weights + D * Dv, std::numeric_limits<acc_t>::quiet_NaN());
    return kIntentionNonFinite;
  }
  if (alpha == acc_t(0) && valid < D) return kIntentionTooFewKeys;
  for (int64_t i = 0; i < D; ++i) {
    stats[i * E + i] += alpha;
    if (!a.has_v) stats[i * E + D + i] = acc_t(1);  // C = I
  }
  // A = stats[:, :D] and C = stats[:, D:] are read in place through their row stride E.
  int32_t info = 0;
  cholesky_factor_batch(stats, BatchStrides{0, E, 1}, factor, &info, D, 0, 1);
  if (info != 0) return info;
  cholesky_solve_batch(factor, BatchStrides{0, D, 1}, stats + D, BatchStrides{0, E, 1}, weights, D, Dv, 0, 1);
  return 0;
}

/// `v` undefined means C = I (then Dv = D).
template <typename scalar_t>
IntentionArgs<scalar_t> make_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& mask) {
  const bool has_v = v.defined();
  return IntentionArgs<scalar_t>{q.const_data_ptr<scalar_t>(), k.const_data_ptr<scalar_t>(),
                                 has_v ? v.const_data_ptr<scalar_t>() : nullptr, has_v,
                                 mask.defined() ? mask.const_data_ptr<bool>() : nullptr,
                                 q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), has_v ? v.size(3) : q.size(3),
                                 q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                                 has_v ? v.stride(0) : 0, has_v ? v.stride(1) : 0, has_v ? v.stride(2) : 0};
}

/// Runs `head(bh, scratch) -> status` for every (batch, head) index bh in [0, count), in parallel,
/// each thread with its own ForwardScratch(D, Dv); a status is 0 or an error of solve_weights
/// (kIntentionNonFinite is not one: heads map it to 0 after writing NaN). Returns the lowest failing
/// index (or -1) and its status, for check_solvable (checks/intention_checks.h): the lowest, not the
/// first a thread happened to find, so that the error names the same head at any thread count.
template <typename acc_t, typename HeadFn>
std::pair<int64_t, int> for_each_head(int64_t count, int64_t D, int64_t Dv, const HeadFn& head) {
  std::mutex lock;  // taken only by a range that failed: never on the normal path
  int64_t failed = -1;
  int failed_info = 0;
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    ForwardScratch<acc_t> scratch(D, Dv);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int info = head(bh, scratch);
      if (info == 0) continue;
      const std::lock_guard<std::mutex> guard(lock);
      if (failed < 0 || bh < failed) failed = bh, failed_info = info;
      break;  // the rest of this range has higher indices; heads left unsolved are never returned
    }
  });
  return {failed, failed_info};
}

}  // namespace attn_ext::cpu::intention
