// CPU backward of attention (docs/spec.md §1 backward, as in FlashAttention): probabilities are
// recomputed per (query tile, key chunk) from the saved log-sum-exp, so no [L, S] matrix exists.
//
// Work is split over (batch, key/value head, part of the keys). Each unit owns the key/value
// gradients of its keys outright, summing them over the query heads of its group (GQA) without
// atomics, and writes a partial query gradient that is summed in a fixed order at the end: the
// result is bit-identical run to run. With a band (causal, sliding window): a key chunk only meets the query
// tiles whose band reaches it, and each tile only the chunk's keys up to its band's end.
//
// With the gradient of an additive mask wanted (attention_bwd_bias: a learned bias), dS is also summed into the
// mask's shape tile by tile, and the work is split over the keys alone (see run_with_mask_gradient): no [L, S]
// buffer is formed.
//
// Masked pairs are never read (attention_masking.h): their P and dS are exactly 0, and a row of
// Q, K or dO holding inf/NaN that meets a masked pair goes through its GEMM as zeros, its allowed
// products being added one pair at a time (0 · inf would otherwise be NaN).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "attention_kernels.h"
#include "mask_gradient.h"
#include "attn_ext/online_softmax.h"
#include "blas.h"
#include "checks/common.h"
#include "tile.h"
#include "vectorized_rows.h"

namespace attn_ext::cpu {
namespace {

constexpr int64_t kQueryTile = 64;

// P = exp(s − lse) loses relative accuracy |lse|·u to the rounding of lse itself: beyond ~2^24 the
// log Σ exp(s − max) ∈ [0, log N] part vanishes entirely (two tied keys get P = 1 each, not ½, and
// every gradient of the row doubles). Rows with |lse| at least this large (relative error of P up
// to 2^-15 otherwise) get their normaliser recomputed exactly as (max, log sum) by a pre-pass over
// the keys. Such scores mean a saturated softmax, so ordinary inputs never pay for the pass.
constexpr float kPreciseNormaliserLse = 512.0f;

template <typename scalar_t>
const scalar_t* matrix_at(const at::Tensor& t, int64_t b, int64_t h, int64_t row) {
  return t.const_data_ptr<scalar_t>() + b * t.stride(0) + h * t.stride(1) + row * t.stride(2);
}

/// The keys of chunk [n0, n0 + nc) that query tile [m0, m0 + mt) may meet: the band's upper edge (the causal
/// diagonal, a window's right side) cuts them after its last query's last key (≤ 0: none). Keys before
/// the band's lower edge stay in the tile (its columns start at n0) and are masked.
inline int64_t tile_keys(const Band& band, int64_t m0, int64_t mt, int64_t n0, int64_t nc) {
  return std::min(nc, m0 + mt + band.hi - n0);
}

/// The key chunk of a call: `chunk`, or with a window bounded on both sides at most its width rounded up to
/// kQueryTile. A key chunk meets the query tiles of its keys' bands, chunk + width queries in all, each tile
/// computing all its keys: with 512-key chunks and a 257-key window 3× the band's pairs, with 320-key ones 2.2×.
inline int64_t band_chunk(const Band& band, int64_t chunk) {
  if (band.lo == -kBandUnbounded || band.hi == kBandUnbounded) return chunk;
  const int64_t width = std::max<int64_t>(band.hi - band.lo + 1, 1);
  return std::min(chunk, (width + kQueryTile - 1) / kQueryTile * kQueryTile);
}

/// Scaled, masked scores [mt, nc] (leading dim nc) of a tile: masked pairs −inf. The pre-pass and the
/// main loop both call this with the same operands, so their scores are bit-identical.
template <typename acc_t, typename Plane>
void masked_scores(const PairRule<Plane>& rule, const TileStatus& st, const acc_t* qt, int64_t ldq, const acc_t* kt,
                   int64_t ldk, acc_t scale, int64_t m0, int64_t mt, int64_t n0, int64_t nc, int64_t D, acc_t* s,
                   acc_t* tanh_out = nullptr) {
  gemm(Transpose::kNo, Transpose::kYes, mt, nc, D, scale, qt, ldq, kt, ldk, acc_t(0), s, nc);
  cap_scores(rule, s, nc, mt, nc, tanh_out);
  add_mask_values(rule, s, nc, m0, mt, n0, nc);
  add_alibi(rule, s, nc, m0, mt, n0, nc);
  if (st.any_masked) fill_masked(rule, st, s, nc, m0, mt, n0, nc, negative_infinity<acc_t>());
}

template <typename scalar_t, typename Plane>
struct Backward {
  using acc_t = acc_type<scalar_t>;
  const AttentionCall& call;
  const at::Tensor &q, &k, &v;
  int64_t B, Hq, Hkv, M, N, D, Dv, group, tile_m, chunk, n_chunks;
  acc_t scale;
  const bool* padding;
  const acc_t* lse;
  // Per query row [B·Hq·L]: Δ − dlse, and the exact normaliser (max, log sum) of rows with a huge lse.
  std::vector<acc_t> delta_minus_dlse, row_shift, row_log_sum;
  std::vector<char> precise;

  Backward(const AttentionCall& c, const at::Tensor& lse_t)
      : call(c), q(c.q), k(c.k), v(c.v), B(q.size(0)), Hq(q.size(1)), Hkv(k.size(1)), M(q.size(2)), N(k.size(2)),
        D(q.size(3)), Dv(v.size(3)), group(Hkv > 0 ? Hq / Hkv : 0),  // Hkv = 0 only with Hq = 0: no work
        tile_m(std::min<int64_t>(kQueryTile, std::max<int64_t>(M, 1))),
        chunk(band_chunk(c.band, std::min<int64_t>(c.chunk, std::max<int64_t>(N, 1)))),
        n_chunks((N + chunk - 1) / chunk),
        scale(static_cast<acc_t>(c.scale)), padding(c.padding.defined() ? c.padding.const_data_ptr<bool>() : nullptr),
        lse(lse_t.const_data_ptr<acc_t>()), segments(call_segments(c)), tiles(work_tiles(segments, tile_m)) {}

  // The segments (batch entries, or a packed batch's sequences) and their query tiles.
  std::vector<Segment> segments;
  std::vector<WorkTile> tiles;

  PairRule<Plane> rule(int64_t segment, int64_t h) const { return pair_rule<Plane>(call, segments, segment, h); }

  void row_deltas(const at::Tensor& out, const at::Tensor& grad_out, const at::Tensor& grad_lse) {
    const acc_t* grad_lse_data = grad_lse.const_data_ptr<acc_t>();
    delta_minus_dlse.resize(B * Hq * M);
    at::parallel_for(0, B * Hq * M, 256, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const int64_t bh = row / M, m = row % M;
        const scalar_t* o = matrix_at<scalar_t>(out, bh / Hq, bh % Hq, m);
        const scalar_t* dout = matrix_at<scalar_t>(grad_out, bh / Hq, bh % Hq, m);
        acc_t delta = 0;
        for (int64_t d = 0; d < Dv; ++d) delta += static_cast<acc_t>(o[d]) * static_cast<acc_t>(dout[d]);
        delta_minus_dlse[row] = delta - grad_lse_data[row];
      }
    });
  }

  // Exact normaliser of rows with a huge lse (kPreciseNormaliserLse), from the main loop's tiles.
  void precise_normalisers() {
    const int64_t n_tiles = static_cast<int64_t>(tiles.size());
    precise.assign(B * Hq * M, 0);
    row_shift.resize(B * Hq * M), row_log_sum.resize(B * Hq * M);
    at::parallel_for(0, Hq * n_tiles, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> scores, q_tile, k_tile;
      std::vector<OnlineSoftmaxRow<acc_t>> rows;
      for (int64_t unit = begin; unit < end; ++unit) {
        const WorkTile& tile = tiles[unit % n_tiles];
        const int64_t h = unit / n_tiles, b = segments[tile.segment].b, bh = b * Hq + h, m0 = tile.m0, mt = tile.mt;
        bool any = false;
        for (int64_t r = 0; r < mt; ++r) {
          const acc_t l = lse[bh * M + m0 + r];
          any = any || (std::isfinite(l) && std::abs(l) >= acc_t(kPreciseNormaliserLse));
        }
        if (!any) continue;
        scores.resize(tile_m * chunk), q_tile.resize(tile_m * D), k_tile.resize(chunk * D), rows.resize(tile_m);
        const PairRule<Plane> pr = rule(tile.segment, h);
        int64_t ldq, ldk;
        const acc_t* qt = rows_as_acc<acc_t>(matrix_at<scalar_t>(q, b, h, m0), q.stride(2), mt, D, q_tile.data(), &ldq);
        std::fill(rows.begin(), rows.begin() + mt, online_softmax_empty<acc_t>());
        int64_t n_first, n_end;  // the tile's keys, chunks counted from the first
        rule_keys(pr, m0, mt, N, &n_first, &n_end);
        for (int64_t n0 = n_first; n0 < n_end; n0 += chunk) {
          const int64_t nc = std::min(chunk, n_end - n0), ncc = nc;
          const TileStatus st = scan_tile(pr, m0, mt, n0, ncc);
          if (st.all_masked) continue;
          const acc_t* kt = rows_as_acc<acc_t>(matrix_at<scalar_t>(k, b, h / group, n0), k.stride(2), nc, D,
                                               k_tile.data(), &ldk);
          masked_scores(pr, st, qt, ldq, kt, ldk, scale, m0, mt, n0, ncc, D, scores.data());
          for (int64_t r = 0; r < mt; ++r) {
            acc_t* row_s = scores.data() + r * ncc;
            online_softmax_advance(rows[r], row_max(row_s, ncc));
            rows[r].sum += exp_shifted_inplace_sum(row_s, ncc, online_softmax_shift(rows[r]));
          }
        }
        for (int64_t r = 0; r < mt; ++r) {
          const int64_t row = bh * M + m0 + r;
          const acc_t l = lse[row];
          // Only rows the forward found finite; a sum that is not > 0 (NaN) keeps the lse path.
          if (!(std::isfinite(l) && std::abs(l) >= acc_t(kPreciseNormaliserLse) && rows[r].sum > acc_t(0))) continue;
          precise[row] = 1, row_shift[row] = rows[r].max, row_log_sum[row] = std::log(rows[r].sum);
        }
      }
    });
  }

  // Per thread: the tiles of one (query tile, key chunk) and of one key chunk.
  struct Scratch {
    ScratchBuffer<acc_t> p, dp, z, pz, capped, q_tile, do_tile, k_tile, v_tile, dk, dv, q_fix, do_fix, k_fix;
    std::vector<int64_t> bad_q, bad_do, bad_k;
    Scratch(int64_t tile_m, int64_t chunk, int64_t D, int64_t Dv, bool dropout, bool softcap)
        : p(tile_m * chunk), dp(tile_m * chunk), z(dropout ? tile_m * chunk : 0), pz(dropout ? tile_m * chunk : 0),
          capped(softcap ? tile_m * chunk : 0), q_tile(tile_m * D), do_tile(tile_m * Dv), k_tile(chunk * D),
          v_tile(chunk * Dv), dk(chunk * D), dv(chunk * Dv), q_fix(tile_m * D), do_fix(tile_m * Dv), k_fix(chunk * D) {}
  };

  /// Key chunk c of a segment and key/value head: its dK, dV (written), its part of dQ (added to the partial sums
  /// `partial_grad_q`, query head bh's rows from (bh − first_bh)·M·D) and of the mask gradient.
  void key_chunk(Scratch& sc, const at::Tensor& grad_out, at::Tensor& grad_k, at::Tensor& grad_v,
                 const MaskGradient<acc_t>& grad_mask, acc_t* partial_grad_q, int64_t first_bh, int64_t segment,
                 int64_t hkv, int64_t c) {
    const Segment& seg = segments[segment];
    const int64_t b = seg.b;
    const bool dropout = call.dropout_p > 0;
    scalar_t* grad_k_data = grad_k.mutable_data_ptr<scalar_t>();
    scalar_t* grad_v_data = grad_v.mutable_data_ptr<scalar_t>();
    const int64_t n0 = seg.k_begin + c * chunk;
    if (n0 >= seg.k_end) return;
    const int64_t nc = std::min(chunk, seg.k_end - n0);
    std::fill(sc.dk.begin(), sc.dk.begin() + nc * D, acc_t(0));
    std::fill(sc.dv.begin(), sc.dv.begin() + nc * Dv, acc_t(0));
    int64_t ldk, ldv, ldq, lddo;
    const acc_t* kt = rows_as_acc<acc_t>(matrix_at<scalar_t>(k, b, hkv, n0), k.stride(2), nc, D, sc.k_tile.data(), &ldk);
    const acc_t* vt = rows_as_acc<acc_t>(matrix_at<scalar_t>(v, b, hkv, n0), v.stride(2), nc, Dv, sc.v_tile.data(), &ldv);
    nonfinite_rows(kt, ldk, nc, D, sc.bad_k);
    for (int64_t h = hkv * group; h < (hkv + 1) * group; ++h) {
      const PairRule<Plane> pr = rule(segment, h);
      const DropoutRule drop = dropout_rule(call, b, h, Hq, M, N);
      const int64_t bh = b * Hq + h;
      acc_t* grad_q_part = partial_grad_q + (bh - first_bh) * M * D;
      int64_t m_first, m_end;  // the segment's queries the band lets see some key of the chunk
      band_queries(pr.band, n0, nc, M, &m_first, &m_end);
      m_first = std::max(m_first, seg.q_begin), m_end = std::min(m_end, seg.q_end);
      for (int64_t m0 = seg.q_begin + (m_first - seg.q_begin) / tile_m * tile_m; m0 < m_end; m0 += tile_m) {
        const int64_t mt = std::min(tile_m, seg.q_end - m0), ncc = tile_keys(pr.band, m0, mt, n0, nc);
        if (ncc <= 0) continue;  // the chunk lies past the tile's band
        const TileStatus st = scan_tile(pr, m0, mt, n0, ncc);
        if (st.all_masked) continue;
        const acc_t* qt = rows_as_acc<acc_t>(matrix_at<scalar_t>(q, b, h, m0), q.stride(2), mt, D, sc.q_tile.data(), &ldq);
        const acc_t* dot = rows_as_acc<acc_t>(matrix_at<scalar_t>(grad_out, b, h, m0), grad_out.stride(2), mt, Dv,
                                              sc.do_tile.data(), &lddo);
        // P = exp(s − lse), 0 for masked pairs and for rows without any allowed key.
        masked_scores(pr, st, qt, ldq, kt, ldk, scale, m0, mt, n0, ncc, D, sc.p.data(),
                      call.softcap > 0 ? sc.capped.data() : nullptr);
        bool nan_row = false;
        for (int64_t r = 0; r < mt; ++r) {
          acc_t* row_p = sc.p.data() + r * ncc;
          const int64_t row = bh * M + m0 + r;
          if (is_negative_infinity(lse[row])) {
            std::fill(row_p, row_p + ncc, acc_t(0));
          } else if (precise[row]) {  // exp((s − max) − log sum): s − max is exact near the max
            for (int64_t j = 0; j < ncc; ++j) row_p[j] -= row_shift[row];
            exp_shifted_inplace_sum(row_p, ncc, row_log_sum[row]);
          } else {
            nan_row = nan_row || std::isnan(lse[row]);
            exp_shifted_inplace_sum(row_p, ncc, lse[row]);
          }
        }
        // A NaN row (lse NaN) has P NaN everywhere; its masked pairs still are not read.
        if (nan_row && st.any_masked) fill_masked(pr, st, sc.p.data(), ncc, m0, mt, n0, ncc, acc_t(0));
        const acc_t* pd = sc.p.data();  // P ∘ Z with dropout
        if (dropout) {
          std::fill(sc.z.begin(), sc.z.begin() + mt * ncc, acc_t(1));
          apply_dropout(drop, sc.z.data(), ncc, m0, mt, n0, ncc);
          for (int64_t i = 0; i < mt * ncc; ++i) sc.pz[i] = sc.p[i] * sc.z[i];
          pd = sc.pz.data();
        }
        const acc_t *q_gemm = qt, *do_gemm = dot, *k_gemm = kt;
        int64_t ldq_gemm = ldq, lddo_gemm = lddo, ldk_gemm = ldk;
        sc.bad_q.clear(), sc.bad_do.clear();
        const bool k_fixup = st.any_masked && !sc.bad_k.empty() && sc.bad_k.front() < ncc;
        if (st.any_masked) {
          nonfinite_rows(qt, ldq, mt, D, sc.bad_q);
          nonfinite_rows(dot, lddo, mt, Dv, sc.bad_do);
          if (!sc.bad_q.empty()) q_gemm = without_rows(qt, ldq, mt, D, sc.bad_q, sc.q_fix.data()), ldq_gemm = D;
          if (!sc.bad_do.empty()) do_gemm = without_rows(dot, lddo, mt, Dv, sc.bad_do, sc.do_fix.data()), lddo_gemm = Dv;
          if (k_fixup) k_gemm = without_rows(kt, ldk, ncc, D, sc.bad_k, sc.k_fix.data()), ldk_gemm = D;
        }
        // dV += (P∘Z)ᵀ·dO ; dP = (dO·Vᵀ)∘Z ; dS = P ⊙ (dP − Δ + dlse) ; dK += scale·dSᵀ·Q ; dQ += scale·dS·K
        gemm(Transpose::kYes, Transpose::kNo, ncc, Dv, mt, acc_t(1), pd, ncc, do_gemm, lddo_gemm, acc_t(1),
             sc.dv.data(), Dv);
        gemm(Transpose::kNo, Transpose::kYes, mt, ncc, Dv, acc_t(1), dot, lddo, vt, ldv, acc_t(0), sc.dp.data(), ncc);
        if (dropout) {
          for (int64_t i = 0; i < mt * ncc; ++i) sc.dp[i] *= sc.z[i];
        }
        for (int64_t r = 0; r < mt; ++r) {
          score_gradient_row(sc.p.data() + r * ncc, sc.dp.data() + r * ncc, sc.dp.data() + r * ncc, ncc,
                             delta_minus_dlse[bh * M + m0 + r]);
        }
        if (grad_mask.wanted()) {  // the mask is added after the cap: its gradient is dS, 0 off the allowed pairs
          if (st.any_masked) fill_masked(pr, st, sc.dp.data(), ncc, m0, mt, n0, ncc, acc_t(0));
          grad_mask.add(sc.dp.data(), b, h, m0, mt, n0, ncc);
        }
        if (call.softcap > 0) {  // through s = c · tanh(s₀ / c): dS₀ = dS · (1 − tanh²)
          for (int64_t i = 0; i < mt * ncc; ++i) sc.dp[i] *= acc_t(1) - sc.capped[i] * sc.capped[i];
        }
        // P = 0 there, but 0 · (dP − Δ) is NaN when dP or Δ is not finite.
        if (st.any_masked) fill_masked(pr, st, sc.dp.data(), ncc, m0, mt, n0, ncc, acc_t(0));
        gemm(Transpose::kYes, Transpose::kNo, ncc, D, mt, scale, sc.dp.data(), ncc, q_gemm, ldq_gemm, acc_t(1),
             sc.dk.data(), D);
        gemm(Transpose::kNo, Transpose::kNo, mt, D, ncc, scale, sc.dp.data(), ncc, k_gemm, ldk_gemm, acc_t(1),
             grad_q_part + m0 * D, D);
        for (int64_t r : sc.bad_do) {
          for (int64_t j = 0; j < ncc; ++j) {
            if (!pair_allowed(pr, m0 + r, n0 + j)) continue;
            for (int64_t d = 0; d < Dv; ++d) sc.dv[j * Dv + d] += pd[r * ncc + j] * dot[r * lddo + d];
          }
        }
        for (int64_t r : sc.bad_q) {
          for (int64_t j = 0; j < ncc; ++j) {
            if (!pair_allowed(pr, m0 + r, n0 + j)) continue;
            for (int64_t d = 0; d < D; ++d) sc.dk[j * D + d] += scale * sc.dp[r * ncc + j] * qt[r * ldq + d];
          }
        }
        for (int64_t j : sc.bad_k) {
          if (!k_fixup || j >= ncc) break;
          for (int64_t r = 0; r < mt; ++r) {
            if (!pair_allowed(pr, m0 + r, n0 + j)) continue;
            for (int64_t d = 0; d < D; ++d) grad_q_part[(m0 + r) * D + d] += scale * sc.dp[r * ncc + j] * kt[j * ldk + d];
          }
        }
      }
    }
    for (int64_t j = 0; j < nc; ++j) {
      scalar_t* gk = grad_k_data + ((b * Hkv + hkv) * N + n0 + j) * D;
      scalar_t* gv = grad_v_data + ((b * Hkv + hkv) * N + n0 + j) * Dv;
      // A padded key takes no part in the attention, so its gradients are 0 even beside a NaN query
      // row, whose dS·Q would otherwise put 0 · NaN = NaN there.
      const bool padded = padding != nullptr && padding[b * N + n0 + j];
      for (int64_t d = 0; d < D; ++d) gk[d] = static_cast<scalar_t>(padded ? acc_t(0) : sc.dk[j * D + d]);
      for (int64_t d = 0; d < Dv; ++d) gv[d] = static_cast<scalar_t>(padded ? acc_t(0) : sc.dv[j * Dv + d]);
    }
  }

  void run(const at::Tensor& grad_out, at::Tensor& grad_q, at::Tensor& grad_k, at::Tensor& grad_v,
           const MaskGradient<acc_t>& grad_mask = {}) {
    if (grad_mask.wanted()) return run_with_mask_gradient(grad_out, grad_q, grad_k, grad_v, grad_mask);
    int64_t pairs = 0;
    for (const Segment& seg : segments) pairs += segment_pairs(seg);
    const int64_t total_macs = 2 * Hq * pairs * (D + Dv);
    // Work units: a segment's keys (a batch entry's, or a packed sequence's) of one key/value head, in parts, each
    // part with its partial dQ sums.
    const int64_t n_segments = static_cast<int64_t>(segments.size());
    const int64_t splits = key_splits_for(n_segments * Hkv, n_chunks, total_macs);
    std::vector<acc_t> partial_grad_q(splits * B * Hq * M * D, acc_t(0));
    const int64_t units = n_segments * Hkv * splits;
    at::parallel_for(0, units, grain_size_for(units, total_macs), [&](int64_t begin, int64_t end) {
      Scratch sc(tile_m, chunk, D, Dv, call.dropout_p > 0, call.softcap > 0);
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t split = unit % splits, segment = unit / (splits * Hkv), hkv = (unit / splits) % Hkv;
        const Segment& seg = segments[segment];
        int64_t c_first, c_last;  // the segment's key chunks, counted from its first key
        split_range((seg.k_end - seg.k_begin + chunk - 1) / chunk, splits, split, &c_first, &c_last);
        for (int64_t c = c_first; c < c_last; ++c) {
          key_chunk(sc, grad_out, grad_k, grad_v, {}, partial_grad_q.data() + split * B * Hq * M * D, 0, segment,
                    hkv, c);
        }
      }
    });
    scalar_t* grad_q_data = grad_q.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, B * Hq * M, 64, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        for (int64_t d = 0; d < D; ++d) {
          acc_t sum = 0;
          for (int64_t split = 0; split < splits; ++split) sum += partial_grad_q[(split * B * Hq * M + row) * D + d];
          grad_q_data[row * D + d] = static_cast<scalar_t>(sum);
        }
      }
    });
  }

  /// The backward with the gradient of an additive mask (attention_bwd_bias): the (segment, key/value head) pairs
  /// one after another, each one's key chunks split over the threads (chunk c to unit c mod splits, the same for
  /// every pair: each of the mask's columns, which its broadcast dims share, is written by one thread; a causal
  /// band's work spreads evenly). Each unit sums its part of the pair's dQ in a buffer of the pair's query rows
  /// (group·M·D), added in a fixed order: beyond the outputs, threads·group·L·D numbers, whatever the batch and
  /// the key count (no [L, S] buffer). A mask broadcast along the keys makes one unit.
  void run_with_mask_gradient(const at::Tensor& grad_out, at::Tensor& grad_q, at::Tensor& grad_k,
                              at::Tensor& grad_v, const MaskGradient<acc_t>& grad_mask) {
    const int64_t splits =
        grad_mask.sn == 0 ? 1 : std::max<int64_t>(1, std::min<int64_t>(n_chunks, at::get_num_threads()));
    const int64_t pair_rows = group * M;
    std::vector<acc_t> partial_grad_q(splits * pair_rows * D);
    scalar_t* grad_q_data = grad_q.mutable_data_ptr<scalar_t>();
    for (int64_t segment = 0; segment < static_cast<int64_t>(segments.size()); ++segment) {
      const Segment& seg = segments[segment];
      for (int64_t hkv = 0; hkv < Hkv; ++hkv) {
        const int64_t first_bh = seg.b * Hq + hkv * group;  // the pair's query heads are consecutive
        std::fill(partial_grad_q.begin(), partial_grad_q.end(), acc_t(0));
        at::parallel_for(0, splits, 1, [&](int64_t begin, int64_t end) {
          Scratch sc(tile_m, chunk, D, Dv, call.dropout_p > 0, call.softcap > 0);
          for (int64_t unit = begin; unit < end; ++unit) {
            for (int64_t c = unit; c < n_chunks; c += splits) {
              key_chunk(sc, grad_out, grad_k, grad_v, grad_mask, partial_grad_q.data() + unit * pair_rows * D,
                        first_bh, segment, hkv, c);
            }
          }
        });
        // The segment's rows of the pair's query heads.
        const int64_t seg_rows = seg.q_end - seg.q_begin;
        at::parallel_for(0, group * seg_rows, 64, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            const int64_t row = (i / seg_rows) * M + seg.q_begin + i % seg_rows;  // within the pair's rows
            for (int64_t d = 0; d < D; ++d) {
              acc_t sum = 0;
              for (int64_t split = 0; split < splits; ++split) sum += partial_grad_q[(split * pair_rows + row) * D + d];
              grad_q_data[(first_bh * M + row) * D + d] = static_cast<scalar_t>(sum);
            }
          }
        });
      }
    }
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(const AttentionCall& call, const at::Tensor& grad_out,
                                                                  const at::Tensor& grad_lse, const at::Tensor& out,
                                                                  const at::Tensor& lse, at::Tensor* grad_mask) {
  const at::Tensor &q = call.q, &k = call.k, &v = call.v;
  at::Tensor grad_q = at::empty(q.sizes(), q.options());
  at::Tensor grad_k = at::empty(k.sizes(), k.options());
  at::Tensor grad_v = at::empty(v.sizes(), v.options());
  if (grad_mask != nullptr) {  // the mask's [B, Hq, L, S] view, its broadcast dims (stride 0) of size 1
    std::vector<int64_t> sizes(4);
    for (int64_t d = 0; d < 4; ++d) sizes[d] = call.attn_mask.stride(d) == 0 ? 1 : call.attn_mask.size(d);
    *grad_mask = at::zeros(sizes, lse.options());
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "attn_ext::attention_bwd", [&] {
    dispatch_mask_kind<scalar_t>(call, [&]<typename Plane>() {
      using acc_t = acc_type<scalar_t>;
      Backward<scalar_t, Plane> bwd(call, lse);
      bwd.row_deltas(out, grad_out, grad_lse);
      bwd.precise_normalisers();
      MaskGradient<acc_t> mask_grad;
      if (grad_mask != nullptr) {
        const at::Tensor& g = *grad_mask;
        mask_grad = {g.mutable_data_ptr<acc_t>(), g.size(0) == 1 ? 0 : g.stride(0), g.size(1) == 1 ? 0 : g.stride(1),
                     g.size(2) == 1 ? 0 : g.stride(2), g.size(3) == 1 ? 0 : g.stride(3)};
      }
      bwd.run(grad_out, grad_q, grad_k, grad_v, mask_grad);
    });
  });
  return {grad_q, grad_k, grad_v};
}

}  // namespace attn_ext::cpu
