// Device side of the per-pair masks (common/attention_mask.h), shared by the forward and backward
// kernels of both families (SIMT and tensor-core), so the NaN rule is written once:
//  * a masked pair's score is *selected* as −inf, never computed as s + (−inf): s may be NaN when the
//    masked key's k row (or the query row) holds NaN, and NaN + (−inf) would leak it;
//  * a masked pair's probability (and score gradient) is stored as −0.0, which no allowed pair
//    produces (exp(x) ≥ +0, and a NaN is not a zero). The products P·V, Pᵀ·dO, dSᵀ·Q and dS·K would
//    still take 0 · NaN from a masked pair's non-finite operand row, so the kernels check each
//    streamed tile for non-finite values once (a block-wide OR) and only then accumulate through
//    masked_fma(), which skips −0.0 coefficients; every other tile keeps its fast path.
// Padded keys (key_padding_mask) keep their cheaper treatment: zero rows at load.
//
// Included by the kernels' headers (nvcc) and by the host emulation tests (g++).
#pragma once

#include <cstdint>
#include <math.h>

#include <cuda_runtime.h>

#include "attn_ext/macros.h"
#include "attn_ext/soft_cap.h"
#include "attention_mask.h"
#include "dtypes.cuh"

namespace attn_ext {
namespace cuda {
namespace detail {

/// A 64-bit tile-relative index held in 32 bits: the kernels compare it with key offsets inside a tile, for which
/// any value beyond ±2^30 acts the same.
__device__ __forceinline__ int tile_offset(int64_t x) {
  constexpr int64_t kFar = int64_t(1) << 30;
  return static_cast<int>(x < -kFar ? -kFar : (x > kFar ? kFar : x));
}

/// The pair rules of one query row m over the keys n0 + j of a tile, relative to n0: the allowed offsets
/// [lo, hi] (causal rule and band), the row of the mask from key n0, ALiBi's centre m + diagonal − n0 (a float:
/// exact up to 2^24, beyond which the distance's own rounding is larger) and slope. Per-pair work in 32 bits.
template <typename scalar_t>
struct PairMaskRow {
  const unsigned char* bool_row;
  const scalar_t* additive_row;
  int64_t stride_n;
  int lo, hi;
  float centre, slope;

  /// The additive term of key n0 + j, as PairMaskHead::bias (−inf when masked).
  __device__ __forceinline__ float bias(int j) const {
    if (j < lo || j > hi) return negative_infinity<float>();
    float term = 0.0f;
    if (bool_row != nullptr) {
      if (bool_row[j * stride_n] == 0) return negative_infinity<float>();
    } else if (additive_row != nullptr) {
      term = to_float(additive_row[j * stride_n]);
    }
    if (slope != 0.0f) term -= slope * fabsf(centre - static_cast<float>(j));
    return term;
  }
};

/// The pair rules of one (batch, query head): causal, the band, where its attn_mask rows start, and the
/// score modifications (soft cap, this head's ALiBi slope).
template <typename scalar_t>
struct PairMaskHead {
  const unsigned char* bool_rows = nullptr;  ///< bool attn_mask at (b, h), or null
  const scalar_t* additive_rows = nullptr;   ///< additive attn_mask at (b, h), or null
  int64_t stride_m = 0, stride_n = 0;
  int64_t band_lo = -kBandUnbounded, band_hi = kBandUnbounded, diagonal = 0;
  float softcap = 0.0f, softcap_inverse = 0.0f, alibi_slope = 0.0f;
  bool causal = false;

  /// Row m's rules over the keys from n0 (see PairMaskRow). The caller reads only keys n0 + j < N of a row m < M
  /// (the mask is not read outside the view).
  __device__ __forceinline__ PairMaskRow<scalar_t> row(int64_t m, int64_t n0) const {
    PairMaskRow<scalar_t> r;
    r.bool_row = bool_rows == nullptr ? nullptr : bool_rows + m * stride_m + n0 * stride_n;
    r.additive_row = additive_rows == nullptr ? nullptr : additive_rows + m * stride_m + n0 * stride_n;
    r.stride_n = stride_n;
    const int64_t hi = causal && band_hi > 0 ? 0 : band_hi;  // the causal rule is the band's hi = 0
    r.lo = tile_offset(m + band_lo - n0), r.hi = tile_offset(m + hi - n0);
    r.centre = static_cast<float>(m + diagonal - n0), r.slope = alibi_slope;
    return r;
  }

  /// The additive term of pair (m, n): 0, the additive mask's value and ALiBi's −slope·|m + diagonal − n|;
  /// −inf when masked (what row(m, n).bias(0) gives, in 64-bit indices: fewer registers where a kernel asks one
  /// pair at a time). The caller guarantees m < M and n < N (the mask is not read outside the view).
  __device__ __forceinline__ float bias(int64_t m, int64_t n) const {
    if ((causal && n > m) || n < m + band_lo || n > m + band_hi) return negative_infinity<float>();
    float term = 0.0f;
    if (bool_rows != nullptr) {
      if (bool_rows[m * stride_m + n * stride_n] == 0) return negative_infinity<float>();
    } else if (additive_rows != nullptr) {
      term = to_float(additive_rows[m * stride_m + n * stride_n]);
    }
    if (alibi_slope != 0.0f) term -= alibi_slope * fabsf(static_cast<float>(m + diagonal - n));
    return term;
  }

  /// An allowed pair's scaled dot product s after the soft cap: c·tanh(s / c) (±inf → ±c, NaN stays), else s.
  __device__ __forceinline__ float capped(float s) const {
    return softcap > 0.0f ? softcap * tanh_from_exp(s * softcap_inverse) : s;
  }

  /// The backward's score of a pair from its unscaled dot product and additive term (its forward's value;
  /// without a soft cap the fused multiply-add the kernels always took), and in `slope` d score / d (scale·dot),
  /// the soft cap's factor of dS: 1 − tanh²(scale·dot / c), else 1 (one tanh for both).
  __device__ __forceinline__ float score(float dot, float scale, float term, float* slope) const {
    if (!(softcap > 0.0f)) {
      *slope = 1.0f;
      return fmaf(dot, scale, term);
    }
    const float t = tanh_from_exp(dot * scale * softcap_inverse);
    *slope = 1.0f - t * t;
    return softcap * t + term;
  }
};

/// A side of the band moved by `shift` (a packed sequence's own diagonal, packed_sequences.h); an unbounded side
/// stays unbounded.
__device__ __forceinline__ int64_t shifted_side(int64_t side, int64_t shift) {
  return side == kBandUnbounded || side == -kBandUnbounded ? side : side + shift;
}

/// The rules of (batch entry or packed sequence b, query head h); `shift` moves the band and ALiBi's diagonal
/// (SequenceView::shift, 0 for a dense batch).
template <typename scalar_t>
__device__ __forceinline__ PairMaskHead<scalar_t> pair_mask_head(const AttentionMaskLayout& l, int64_t b, int64_t h,
                                                                 int64_t shift = 0) {
  PairMaskHead<scalar_t> head;
  head.causal = l.causal;
  head.band_lo = shifted_side(l.band_lo, shift), head.band_hi = shifted_side(l.band_hi, shift);
  head.diagonal = l.diagonal + shift;
  head.softcap = l.softcap, head.softcap_inverse = l.softcap_inverse;
  if (l.alibi_slopes != nullptr) head.alibi_slope = l.alibi_slopes[b * l.alibi_stride_b + h * l.alibi_stride_h];
  head.stride_m = l.attn_mask_stride_m, head.stride_n = l.attn_mask_stride_n;
  const int64_t offset = b * l.attn_mask_stride_b + h * l.attn_mask_stride_h;
  if (l.attn_mask != nullptr && l.attn_mask_kind == AttnMaskKind::kBool) {
    head.bool_rows = static_cast<const unsigned char*>(l.attn_mask) + offset;
  } else if (l.attn_mask != nullptr && l.attn_mask_kind == AttnMaskKind::kAdditive) {
    head.additive_rows = static_cast<const scalar_t*>(l.attn_mask) + offset;
  }
  return head;
}

/// A half-open range of keys or queries.
struct IndexRange {
  int64_t begin, end;
};

/// The keys [begin, end) ⊂ [0, N) that some query of rows [m0, m_end) may attend under the causal rule and
/// the band ([0, N) without either), the band moved by `shift` as in pair_mask_head: the kernels' key loops
/// visit only the tiles holding them.
__device__ __forceinline__ IndexRange band_keys(const AttentionMaskLayout& l, int64_t m0, int64_t m_end, int64_t N,
                                                int64_t shift = 0) {
  int64_t begin = 0, end = N;
  if (l.causal && m_end < end) end = m_end;
  const int64_t lo = l.band_lo + shift, hi = l.band_hi + shift;  // read only when bounded
  if (l.band_lo != -kBandUnbounded) begin = m0 + lo < 0 ? 0 : (m0 + lo < N ? m0 + lo : N);
  if (l.band_hi != kBandUnbounded && m_end + hi < end) end = m_end + hi;
  return IndexRange{begin, end < begin ? begin : end};
}

/// The queries [begin, end) ⊂ [0, M) that may attend some key of [n0, n_end) under the causal rule and the
/// band (moved by `shift`): the dK/dV kernels' query loops visit only the tiles holding them.
__device__ __forceinline__ IndexRange band_queries(const AttentionMaskLayout& l, int64_t n0, int64_t n_end, int64_t M,
                                                   int64_t shift = 0) {
  int64_t begin = 0, end = M;
  if (l.causal) begin = n0 < M ? n0 : M;
  const int64_t lo = l.band_lo + shift, hi = l.band_hi + shift;  // read only when bounded
  if (l.band_hi != kBandUnbounded && n0 - hi > begin) begin = n0 - hi < M ? n0 - hi : M;
  if (l.band_lo != -kBandUnbounded && n_end - lo < end) end = n_end - lo;
  return IndexRange{begin, end < begin ? begin : end};
}

/// A masked pair's score: −inf selected (see the file comment), else s + bias.
__device__ __forceinline__ float masked_score(float s, float bias) {
  return is_negative_infinity(bias) ? negative_infinity<float>() : s + bias;
}

/// The probability / score-gradient marker of a masked pair, and its test (true only for −0.0).
__device__ __forceinline__ float masked_coefficient() { return -0.0f; }
__device__ __forceinline__ bool is_masked_coefficient(float c) { return c == 0.0f && signbit(c); }

/// An allowed pair's coefficient as stored in scalar_t: a zero (+0.0 or −0.0, e.g. a probability that
/// underflowed times a negative factor, or a tiny negative dS rounded to 16 bits) is stored as +0.0,
/// so that only masked pairs carry the marker and an allowed pair keeps IEEE products (0 · inf = NaN).
template <typename scalar_t>
__device__ __forceinline__ scalar_t allowed_coefficient(float x) {
  const scalar_t stored = from_float<scalar_t>(x);
  return to_float(stored) == 0.0f ? from_float<scalar_t>(0.0f) : stored;
}

/// acc + c·x, except that a masked pair's coefficient contributes nothing whatever x holds.
__device__ __forceinline__ float masked_fma(float c, float x, float acc) {
  return is_masked_coefficient(c) ? acc : fmaf(c, x, acc);
}

__device__ __forceinline__ bool is_finite_value(float x) { return isfinite(x); }

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
