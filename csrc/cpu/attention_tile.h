// One tile of query rows attending over a range of key chunks (docs/spec.md §1): scores by GEMM, the
// online-softmax row update of the shared header, the value GEMM into an fp32 accumulator. Used by
// the attention forward (cross attention is its unmasked case) and by σIntention's fused forward,
// which feeds it transformed queries.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "attention_masking.h"
#include "attn_ext/online_softmax.h"
#include "blas.h"
#include "tile.h"
#include "vectorized_rows.h"

namespace attn_ext::cpu {

// 128 query rows × 512 keys of fp32 scores stay in a 2 MB L2 next to the value accumulator, and
// the two GEMMs per chunk are large enough for the BLAS to run near its peak (measured: 64 rows
// cost 10-15 % more at N = 3e4, 32 rows 50 %).
constexpr int64_t kQueryTile = 128;

/// Keys and values of one (batch, head): row `n` of K at `k + n * k_row_stride` (D elements, unit
/// stride), likewise V with Dv; `padding` is that batch entry's [N] flags (true = padding) or null.
/// A paged cache (`blocks` not null): row n is row n % block_size of block blocks[n / block_size], which
/// starts at `k + block * k_block_stride` (likewise V).
template <typename scalar_t>
struct KeyValueRows {
  const scalar_t* k;
  const scalar_t* v;
  int64_t k_row_stride, v_row_stride;
  const bool* padding;
  int64_t N, D, Dv;
  const int32_t* blocks = nullptr;
  int64_t block_size = 0, k_block_stride = 0, v_block_stride = 0;
};

/// Rows [n0, n0 + nc) of K (`keys`) or V of `kv` as acc_t rows (see rows_as_acc): a view where the rows lie
/// evenly spaced (always without a block table; within one block with it), else copied into `scratch`.
template <typename acc_t, typename scalar_t>
const acc_t* kv_rows_as_acc(const KeyValueRows<scalar_t>& kv, bool keys, int64_t n0, int64_t nc, acc_t* scratch,
                            int64_t* ld) {
  const scalar_t* base = keys ? kv.k : kv.v;
  const int64_t stride = keys ? kv.k_row_stride : kv.v_row_stride, cols = keys ? kv.D : kv.Dv;
  if (kv.blocks == nullptr) return rows_as_acc<acc_t>(base + n0 * stride, stride, nc, cols, scratch, ld);
  const int64_t block_stride = keys ? kv.k_block_stride : kv.v_block_stride, bs = kv.block_size;
  auto row = [&](int64_t n) { return base + kv.blocks[n / bs] * block_stride + (n % bs) * stride; };
  if (n0 / bs == (n0 + nc - 1) / bs) return rows_as_acc<acc_t>(row(n0), stride, nc, cols, scratch, ld);
  for (int64_t r = 0; r < nc; ++r) {  // the chunk spans blocks: its rows gathered, in acc_t
    const scalar_t* src = row(n0 + r);
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      std::copy(src, src + cols, scratch + r * cols);
    } else {
      for (int64_t c = 0; c < cols; ++c) scratch[r * cols + c] = static_cast<acc_t>(src[c]);
    }
  }
  *ld = cols;
  return scratch;
}

/// Per-thread buffers of attend_tile for tiles of up to `tile_m` rows and chunks of `chunk` keys.
template <typename acc_t>
struct AttentionTileScratch {
  ScratchBuffer<acc_t> scores, acc, k_tile, v_tile, v_fix;
  std::vector<OnlineSoftmaxRow<acc_t>> rows;
  std::vector<int64_t> bad;  ///< value rows of the chunk holding inf/NaN
  AttentionTileScratch(int64_t tile_m, int64_t chunk, int64_t D, int64_t Dv)
      : scores(tile_m * chunk), acc(tile_m * Dv), k_tile(chunk * D), v_tile(chunk * Dv), v_fix(chunk * Dv),
        rows(tile_m) {}
};

/// Streams key chunks [c_first, c_last) (of `chunk` keys, counted from the first key the band lets the tile
/// see: 0 without a lower edge; `fresh` false: added to the state w holds) for the `mt` query rows m0.. `qt` (acc_t,
/// leading dimension ldq). Leaves the unnormalised accumulator in `w.acc` [mt, Dv] and the row
/// states in `w.rows`; store_tile finishes the rows. `rule` says which pairs take part (its padding,
/// not kv.padding, is used), `dropout` which of them are dropped from P·V.
///
/// The band (causal rule, sliding window): the chunks outside the keys some row of the tile may see are
/// never visited, and the last one is cut short at the band's end (only the triangles of the blocks the
/// band's edges cross are computed in vain).
/// NaN needs no work here (see attn_ext/online_softmax.h): a NaN score makes that row's sum and
/// accumulator NaN, which store_tile reports. Masked pairs are never read: their scores are replaced
/// by −inf, and when a value row holding inf/NaN meets a masked pair (probability 0, 0 · inf = NaN)
/// the row goes through the GEMM as zeros and its allowed products are added one by one.
template <typename scalar_t, typename acc_t, typename Plane>
void attend_tile(const acc_t* qt, int64_t ldq, int64_t m0, int64_t mt, acc_t scale, const KeyValueRows<scalar_t>& kv,
                 const PairRule<Plane>& rule, const DropoutRule& dropout, int64_t chunk, int64_t c_first,
                 int64_t c_last, AttentionTileScratch<acc_t>& w, bool fresh = true) {
  const int64_t D = kv.D, Dv = kv.Dv;
  int64_t n_first, n_end;  // the keys the band lets some row of the tile see; chunk c starts at n_first + c·chunk
  rule_keys(rule, m0, mt, kv.N, &n_first, &n_end);
  if (fresh) {  // else the chunks continue the state w holds (a caller interleaving tiles chunk by chunk)
    std::fill(w.acc.begin(), w.acc.begin() + mt * Dv, acc_t(0));
    std::fill(w.rows.begin(), w.rows.begin() + mt, online_softmax_empty<acc_t>());
  }
  for (int64_t c = c_first; c < c_last && n_first + c * chunk < n_end; ++c) {
    const int64_t n0 = n_first + c * chunk, nc = std::min(chunk, n_end - n0);
    const TileStatus st = scan_tile(rule, m0, mt, n0, nc);
    if (st.all_masked) continue;  // changes nothing
    int64_t ldk, ldv;
    const acc_t* kt = kv_rows_as_acc<acc_t>(kv, true, n0, nc, w.k_tile.data(), &ldk);
    const acc_t* vt = kv_rows_as_acc<acc_t>(kv, false, n0, nc, w.v_tile.data(), &ldv);
    const acc_t* v_gemm = vt;
    int64_t ldv_gemm = ldv;
    w.bad.clear();
    if (st.any_masked) {
      nonfinite_rows(vt, ldv, nc, Dv, w.bad);
      if (!w.bad.empty()) v_gemm = without_rows(vt, ldv, nc, Dv, w.bad, w.v_fix.data()), ldv_gemm = Dv;
    }
    acc_t* scores = w.scores.data();
    gemm(Transpose::kNo, Transpose::kYes, mt, nc, D, scale, qt, ldq, kt, ldk, acc_t(0), scores, nc);
    cap_scores(rule, scores, nc, mt, nc, static_cast<acc_t*>(nullptr));
    add_mask_values(rule, scores, nc, m0, mt, n0, nc);
    add_alibi(rule, scores, nc, m0, mt, n0, nc);
    if (st.any_masked) fill_masked(rule, st, scores, nc, m0, mt, n0, nc, negative_infinity<acc_t>());
    for (int64_t r = 0; r < mt; ++r) {
      acc_t* row_scores = scores + r * nc;
      const acc_t factor = online_softmax_advance(w.rows[r], row_max(row_scores, nc));
      w.rows[r].sum += exp_shifted_inplace_sum(row_scores, nc, online_softmax_shift(w.rows[r]));
      if (factor != acc_t(1)) {
        for (int64_t d = 0; d < Dv; ++d) w.acc[r * Dv + d] *= factor;
      }
    }
    if (dropout.active) apply_dropout(dropout, scores, nc, m0, mt, n0, nc);  // the sums above are undropped
    gemm(Transpose::kNo, Transpose::kNo, mt, Dv, nc, acc_t(1), scores, nc, v_gemm, ldv_gemm, acc_t(1), w.acc.data(), Dv);
    for (int64_t j : w.bad) {
      for (int64_t r = 0; r < mt; ++r) {
        if (!pair_allowed(rule, m0 + r, n0 + j)) continue;
        const acc_t p = scores[r * nc + j];
        for (int64_t d = 0; d < Dv; ++d) w.acc[r * Dv + d] += p * vt[j * ldv + d];
      }
    }
  }
}

/// Cross attention's tile (key padding of kv only): σIntention's fused forward.
template <typename scalar_t, typename acc_t>
void attend_tile(const acc_t* qt, int64_t ldq, int64_t mt, acc_t scale, const KeyValueRows<scalar_t>& kv,
                 int64_t chunk, int64_t c_first, int64_t c_last, AttentionTileScratch<acc_t>& w) {
  const PairRule<NoMask> rule{kv.padding, NoMask{}, Band{}};
  const DropoutRule no_dropout{false, 0, 0, 1.0, 0, 0};
  attend_tile(qt, ldq, 0, mt, scale, kv, rule, no_dropout, chunk, c_first, c_last, w);
}

/// Normalises the tile's rows and writes them: out rows [mt, Dv] (row stride Dv) and lse [mt]. Returns
/// whether every value written is finite (x − x is 0 only for finite x; an and-reduction on values in
/// registers, the cheap first step of check_scores_in_range).
template <typename scalar_t, typename acc_t>
bool store_tile(const AttentionTileScratch<acc_t>& w, int64_t mt, int64_t Dv, scalar_t* out, acc_t* lse) {
  int finite = 1;
  for (int64_t r = 0; r < mt; ++r) {
    const OnlineSoftmaxResult<acc_t> done = online_softmax_finish(w.rows[r]);
    for (int64_t d = 0; d < Dv; ++d) {
      const acc_t value = w.acc[r * Dv + d] * done.inv_sum;
      finite &= (value - value) == acc_t(0);
      out[r * Dv + d] = static_cast<scalar_t>(value);
    }
    lse[r] = done.lse;
    finite &= (done.lse - done.lse) == acc_t(0);
  }
  return finite != 0;
}

/// Merges `splits` normalised partial states per row (docs/spec.md §1 merge) into out [rows, Dv] and lse
/// [rows]: partial_out [splits, rows, Dv], partial_lse [splits, rows], split-major. Returns whether every
/// value written is finite, as store_tile.
template <typename scalar_t, typename acc_t>
bool merge_partial_states(const acc_t* partial_out, const acc_t* partial_lse, int64_t splits, int64_t rows,
                          int64_t Dv, scalar_t* out, acc_t* lse) {
  std::atomic<bool> all_finite{true};
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> merged(Dv);
    int finite = 1;
    for (int64_t row = begin; row < end; ++row) {
      acc_t merged_lse = negative_infinity<acc_t>();
      std::fill(merged.begin(), merged.end(), acc_t(0));
      for (int64_t split = 0; split < splits; ++split) {
        const StateMergeWeights<acc_t> w = state_merge_weights(merged_lse, partial_lse[split * rows + row]);
        const acc_t* po = partial_out + (split * rows + row) * Dv;
        for (int64_t d = 0; d < Dv; ++d) merged[d] = w.weight_a * merged[d] + w.weight_b * po[d];
        merged_lse = w.lse;
      }
      for (int64_t d = 0; d < Dv; ++d) {
        finite &= (merged[d] - merged[d]) == acc_t(0);
        out[row * Dv + d] = static_cast<scalar_t>(merged[d]);
      }
      lse[row] = merged_lse;
      finite &= (merged_lse - merged_lse) == acc_t(0);
    }
    if (!finite) all_finite = false;
  });
  return all_finite;
}

/// Where the tiles of a forward whose keys may be split into `splits` parts (key_splits_for) leave their rows: with
/// one part straight into out [rows, Dv] and lse [rows]; with more, each part's normalised partial state, merged by
/// finish(). all_finite: whether every value written was (store_tile's and merge_partial_states' report).
template <typename scalar_t, typename acc_t>
struct SplitRows {
  int64_t splits, rows, Dv;
  scalar_t* out;
  acc_t* lse;
  std::vector<acc_t> partial_out, partial_lse;
  std::atomic<bool> all_finite{true};

  SplitRows(int64_t splits_, int64_t rows_, int64_t Dv_, scalar_t* out_, acc_t* lse_)
      : splits(splits_), rows(rows_), Dv(Dv_), out(out_), lse(lse_),
        partial_out(splits_ > 1 ? splits_ * rows_ * Dv_ : 0), partial_lse(splits_ > 1 ? splits_ * rows_ : 0) {}

  /// Stores the tile `w` of `mt` rows from `row` on, computed over key part `split`.
  void store(const AttentionTileScratch<acc_t>& w, int64_t split, int64_t row, int64_t mt) {
    const bool finite = splits == 1 ? store_tile(w, mt, Dv, out + row * Dv, lse + row)
                                    : store_tile(w, mt, Dv, partial_out.data() + (split * rows + row) * Dv,
                                                 partial_lse.data() + split * rows + row);
    if (splits == 1 && !finite) all_finite = false;  // a partial state's rows are judged once merged
  }

  /// Merges the parts (with more than one); returns all_finite.
  bool finish() {
    if (splits > 1) all_finite = merge_partial_states(partial_out.data(), partial_lse.data(), splits, rows, Dv, out, lse);
    return all_finite;
  }
};

}  // namespace attn_ext::cpu
