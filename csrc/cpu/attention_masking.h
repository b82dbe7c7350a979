// Which (query, key) pairs of a tile take part in the attention, and the per-tile work that follows
// from it: key padding, the band (causal diagonal, sliding window), an attn_mask read through its strides
// (bool, or additive float), dropout, and the "never read a masked pair" rule for non-finite operands.
//
// The attn_mask kind is a compile-time policy (NoMask, MaskPlane<bool>, MaskPlane<scalar_t>), so the
// unmasked path (cross attention without padding) has no per-element work at all. Everything else is
// decided once per tile by scan_tile, so tiles without masked pairs take the plain GEMM path.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attn_ext/macros.h"
#include "attn_ext/philox.h"

namespace attn_ext::cpu {

/// No attn_mask.
struct NoMask {};

/// The attn_mask of one (batch, query head): pair (m, n) at data[m·row_stride + n·col_stride]; either
/// stride may be 0 (a broadcast dim). mask_t = bool (true = take part) or the inputs' float type
/// (added to the scaled score; −inf masks the pair).
template <typename mask_t>
struct MaskPlane {
  const mask_t* data;
  int64_t row_stride, col_stride;
};

template <typename Plane>
constexpr bool kHasMask = !std::is_same_v<Plane, NoMask>;
template <typename Plane>
constexpr bool kAdditiveMask = kHasMask<Plane> && !std::is_same_v<Plane, MaskPlane<bool>>;

/// A side of a Band without a limit: far beyond any index difference, and far from int64's ends.
constexpr int64_t kBandUnbounded = int64_t(1) << 62;

/// The keys n that query m may attend by position: m + lo ≤ n ≤ m + hi. The causal rule is hi = diagonal
/// (0 top-left; S − L with the queries aligned to the end of the keys), a sliding window (left, right)
/// about the diagonal key lo = diagonal − left, hi = diagonal + right; ±kBandUnbounded where a side has
/// no limit (cross attention: both).
struct Band {
  int64_t lo = -kBandUnbounded, hi = kBandUnbounded;
  bool active() const { return lo != -kBandUnbounded || hi != kBandUnbounded; }
};

/// The band of the op arguments is_causal, window_left, window_right (−1: unbounded) and diagonal.
inline Band make_band(bool causal, int64_t window_left, int64_t window_right, int64_t diagonal) {
  Band band;
  if (window_left >= 0) band.lo = diagonal - window_left;
  if (causal) band.hi = diagonal;
  if (window_right >= 0) band.hi = std::min(band.hi, diagonal + window_right);
  return band;
}

/// Keys [*first, *end) ⊂ [0, N) that some query of rows [m0, m0 + mt) may attend.
inline void band_keys(const Band& band, int64_t m0, int64_t mt, int64_t N, int64_t* first, int64_t* end) {
  *first = std::clamp<int64_t>(m0 + band.lo, 0, N);
  *end = std::clamp<int64_t>(m0 + mt + band.hi, *first, N);
}

/// Queries [*first, *end) ⊂ [0, M) that may attend some key of [n0, n0 + nc).
inline void band_queries(const Band& band, int64_t n0, int64_t nc, int64_t M, int64_t* first, int64_t* end) {
  *first = std::clamp<int64_t>(n0 - band.hi, 0, M);
  *end = std::clamp<int64_t>(n0 + nc - band.lo, *first, M);
}

/// Everything that masks pairs of one (batch, query head).
template <typename Plane>
struct PairRule {
  const bool* padding;  ///< [N] flags of the batch entry (true = padding), or null
  Plane mask;
  Band band;  ///< key n takes part for query m only if m + band.lo ≤ n ≤ m + band.hi
  int64_t key_begin = 0, key_end = kBandUnbounded;  ///< and key_begin ≤ n < key_end (a packed sequence's keys)
  // What turns the scaled dot products of the allowed pairs into scores, before and beside the mask:
  double softcap = 0;      ///< c > 0: s = c · tanh(s / c) (Gemma 2, Grok); 0: none
  double alibi_slope = 0;  ///< ≠ 0: s −= slope · |m + diagonal − n| (ALiBi, this query head's slope)
  int64_t diagonal = 0;    ///< query m's diagonal key m + diagonal, for ALiBi's distance
  bool modifies_scores() const { return softcap > 0 || alibi_slope != 0; }
};

/// The soft cap of a tile's scaled dot products [mt, nc] (leading dim ld), in place: s ← c · tanh(s / c).
/// `tanh_out` (leading dim nc), when not null, receives tanh(s / c), the backward's chain rule factor
/// 1 − tanh². ±inf becomes ±c, NaN stays NaN.
template <typename Plane, typename acc_t>
void cap_scores(const PairRule<Plane>& rule, acc_t* tile, int64_t ld, int64_t mt, int64_t nc, acc_t* tanh_out) {
  if (!(rule.softcap > 0)) return;
  const acc_t c = static_cast<acc_t>(rule.softcap), inv_c = acc_t(1) / c;
  for (int64_t r = 0; r < mt; ++r) {
    acc_t* row = tile + r * ld;
    for (int64_t j = 0; j < nc; ++j) {
      const acc_t t = std::tanh(row[j] * inv_c);
      if (tanh_out != nullptr) tanh_out[r * nc + j] = t;
      row[j] = c * t;
    }
  }
}

/// ALiBi's linear bias of a tile of rows m0.., keys n0..: s −= slope · |m + diagonal − n|.
template <typename Plane, typename acc_t>
void add_alibi(const PairRule<Plane>& rule, acc_t* tile, int64_t ld, int64_t m0, int64_t mt, int64_t n0, int64_t nc) {
  if (rule.alibi_slope == 0) return;
  const acc_t slope = static_cast<acc_t>(rule.alibi_slope);
  for (int64_t r = 0; r < mt; ++r) {
    acc_t* row = tile + r * ld;
    const int64_t diag = m0 + r + rule.diagonal - n0;  // key n0 + j is |diag − j| from the query's diagonal
    for (int64_t j = 0; j < nc; ++j) row[j] -= slope * static_cast<acc_t>(diag > j ? diag - j : j - diag);
  }
}

template <typename Plane>
inline bool pair_allowed(const PairRule<Plane>& rule, int64_t m, int64_t n) {
  if (rule.padding != nullptr && rule.padding[n]) return false;
  if (n < m + rule.band.lo || n > m + rule.band.hi || n < rule.key_begin || n >= rule.key_end) return false;
  if constexpr (kHasMask<Plane>) {
    const auto value = rule.mask.data[m * rule.mask.row_stride + n * rule.mask.col_stride];
    if constexpr (kAdditiveMask<Plane>) {
      return !(static_cast<double>(value) == -HUGE_VAL);
    } else {
      return value;
    }
  }
  return true;
}

/// What a tile [m0, m0 + mt) × [n0, n0 + nc) holds.
struct TileStatus {
  bool padded;       ///< some key of the tile is padding
  bool band_cut;     ///< an edge of the band (the causal diagonal, a window's side) crosses the tile
  bool mask_cut;     ///< attn_mask masks some pair of the tile
  bool all_masked;   ///< no pair takes part (a sufficient test: the tile may be skipped)
  bool any_masked;   ///< padded || band_cut || mask_cut
};

/// One pass over the tile's mask entries (none without attn_mask).
template <typename Plane>
TileStatus scan_tile(const PairRule<Plane>& rule, int64_t m0, int64_t mt, int64_t n0, int64_t nc) {
  TileStatus st{false, false, false, false, false};
  if (rule.padding != nullptr) {
    int64_t valid = 0;
    for (int64_t j = 0; j < nc; ++j) valid += rule.padding[n0 + j] ? 0 : 1;
    st.padded = valid < nc;
    st.all_masked = valid == 0;
  }
  if (rule.band.active()) {
    const Band& band = rule.band;
    st.band_cut = n0 < m0 + mt - 1 + band.lo || n0 + nc - 1 > m0 + band.hi;
    st.all_masked = st.all_masked || n0 + nc - 1 < m0 + band.lo || n0 > m0 + mt - 1 + band.hi;
  }
  if constexpr (kHasMask<Plane>) {
    if (st.all_masked) return st;  // (any_masked is not needed then)
    const int64_t rs = rule.mask.row_stride, cs = rule.mask.col_stride;
    // A broadcast dim has stride 0: its rows (or columns) repeat, so one of them says it all.
    const int64_t rows = rs == 0 ? 1 : mt, cols = cs == 0 ? 1 : nc;
    int64_t allowed = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const auto* row = rule.mask.data + (m0 + r) * rs + n0 * cs;
      for (int64_t j = 0; j < cols; ++j) {
        if constexpr (kAdditiveMask<Plane>) {
          allowed += static_cast<double>(row[j * cs]) == -HUGE_VAL ? 0 : 1;
        } else {
          allowed += row[j * cs] ? 1 : 0;
        }
      }
    }
    st.mask_cut = allowed < rows * cols;
    st.all_masked = allowed == 0;
  }
  st.any_masked = st.padded || st.band_cut || st.mask_cut;
  return st;
}

/// Adds an additive attn_mask to the tile's scaled scores (ld = row stride of `tile`).
template <typename Plane, typename acc_t>
void add_mask_values(const PairRule<Plane>& rule, acc_t* tile, int64_t ld, int64_t m0, int64_t mt, int64_t n0,
                     int64_t nc) {
  if constexpr (kAdditiveMask<Plane>) {
    const int64_t rs = rule.mask.row_stride, cs = rule.mask.col_stride;
    for (int64_t r = 0; r < mt; ++r) {
      const auto* mrow = rule.mask.data + (m0 + r) * rs + n0 * cs;
      acc_t* row = tile + r * ld;
      for (int64_t j = 0; j < nc; ++j) row[j] += static_cast<acc_t>(mrow[j * cs]);
    }
  }
}

/// Keys [*first, *end) ⊂ [0, N) that some query of rows [m0, m0 + mt) may attend under `rule`'s band and key range.
template <typename Plane>
void rule_keys(const PairRule<Plane>& rule, int64_t m0, int64_t mt, int64_t N, int64_t* first, int64_t* end) {
  band_keys(rule.band, m0, mt, N, first, end);
  *first = std::clamp<int64_t>(*first, std::min(rule.key_begin, N), std::min(rule.key_end, N));
  *end = std::clamp<int64_t>(*end, *first, std::min(rule.key_end, N));
}

/// Writes `value` over every masked pair of the tile (−inf into scores, 0 into score gradients),
/// whatever was computed there: a masked pair's inputs are never read.
template <typename Plane, typename acc_t>
void fill_masked(const PairRule<Plane>& rule, const TileStatus& st, acc_t* tile, int64_t ld, int64_t m0, int64_t mt,
                 int64_t n0, int64_t nc, acc_t value) {
  for (int64_t r = 0; r < mt; ++r) {
    acc_t* row = tile + r * ld;
    if constexpr (kHasMask<Plane>) {
      if (st.mask_cut) {
        const int64_t rs = rule.mask.row_stride, cs = rule.mask.col_stride;
        const auto* mrow = rule.mask.data + (m0 + r) * rs + n0 * cs;
        for (int64_t j = 0; j < nc; ++j) {
          if constexpr (kAdditiveMask<Plane>) {
            row[j] = static_cast<double>(mrow[j * cs]) == -HUGE_VAL ? value : row[j];
          } else {
            row[j] = mrow[j * cs] ? row[j] : value;
          }
        }
      }
    }
    if (st.padded) {
      for (int64_t j = 0; j < nc; ++j) row[j] = rule.padding[n0 + j] ? value : row[j];
    }
    if (st.band_cut) {  // keys n < m + lo: columns before m + lo − n0; n > m + hi: from m + hi − n0 + 1 on
      const int64_t first = std::clamp<int64_t>(m0 + r + rule.band.lo - n0, 0, nc);
      const int64_t end = std::clamp<int64_t>(m0 + r + rule.band.hi - n0 + 1, 0, nc);
      for (int64_t j = 0; j < first; ++j) row[j] = value;
      for (int64_t j = std::max(end, first); j < nc; ++j) row[j] = value;
    }
  }
}

/// Dropout of one (batch, query head): pair (m, n) has counter plane_base + m·keys + n.
struct DropoutRule {
  bool active;
  uint64_t seed;
  uint32_t threshold;
  double keep_scale;  ///< 1 / (1 − p)
  uint64_t plane_base;
  int64_t keys;
};

/// tile[r, j] ← tile[r, j] · Z(m0 + r, n0 + j), Z = 1/(1 − p) for a kept pair, 0 for a dropped one.
template <typename acc_t>
void apply_dropout(const DropoutRule& d, acc_t* tile, int64_t ld, int64_t m0, int64_t mt, int64_t n0, int64_t nc) {
  const acc_t keep = static_cast<acc_t>(d.keep_scale);
  for (int64_t r = 0; r < mt; ++r) {
    acc_t* row = tile + r * ld;
    const uint64_t base = d.plane_base + static_cast<uint64_t>(m0 + r) * d.keys + n0;
    for (int64_t j = 0; j < nc; ++j) {
      const bool kept = philox_dropout_word(d.seed, base + j) >= d.threshold;
      row[j] *= kept ? keep : acc_t(0);
    }
  }
}

/// Indices of the rows of a [rows, cols] acc_t tile (leading dim ld) that hold inf or NaN.
template <typename acc_t>
void nonfinite_rows(const acc_t* a, int64_t ld, int64_t rows, int64_t cols, std::vector<int64_t>& bad) {
  bad.clear();
  for (int64_t r = 0; r < rows; ++r) {
    const acc_t* row = a + r * ld;
    int finite = 1;  // x − x is 0 for finite x, NaN for inf and NaN; an and-reduction the compiler vectorises
    for (int64_t c = 0; c < cols; ++c) finite &= (row[c] - row[c]) == acc_t(0);
    if (!finite) bad.push_back(r);
  }
}

/// A copy of the tile into `scratch` (leading dim cols) with the rows `bad` set to zero, for a GEMM
/// whose masked products 0 · inf would poison allowed pairs; the caller adds the bad rows' allowed
/// products back one pair at a time.
template <typename acc_t>
const acc_t* without_rows(const acc_t* a, int64_t ld, int64_t rows, int64_t cols, const std::vector<int64_t>& bad,
                          acc_t* scratch) {
  for (int64_t r = 0; r < rows; ++r) std::copy(a + r * ld, a + r * ld + cols, scratch + r * cols);
  for (int64_t r : bad) std::fill(scratch + r * cols, scratch + (r + 1) * cols, acc_t(0));
  return scratch;
}

}  // namespace attn_ext::cpu
