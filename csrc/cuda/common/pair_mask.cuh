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
#include "attention_mask.h"
#include "dtypes.cuh"

namespace attn_ext {
namespace cuda {
namespace detail {

/// The pair masks of one (batch, query head): causal, and where its attn_mask rows start.
template <typename scalar_t>
struct PairMaskHead {
  const unsigned char* bool_rows = nullptr;  ///< bool attn_mask at (b, h), or null
  const scalar_t* additive_rows = nullptr;   ///< additive attn_mask at (b, h), or null
  int64_t stride_m = 0, stride_n = 0;
  bool causal = false;

  /// The additive term of pair (m, n): 0 or the additive mask's value, −inf when masked. The caller
  /// guarantees m < M and n < N (the mask is not read outside the view).
  __device__ __forceinline__ float bias(int64_t m, int64_t n) const {
    if (causal && n > m) return negative_infinity<float>();
    if (bool_rows != nullptr) return bool_rows[m * stride_m + n * stride_n] != 0 ? 0.0f : negative_infinity<float>();
    if (additive_rows != nullptr) return to_float(additive_rows[m * stride_m + n * stride_n]);
    return 0.0f;
  }
};

template <typename scalar_t>
__device__ __forceinline__ PairMaskHead<scalar_t> pair_mask_head(const AttentionMaskLayout& l, int64_t b, int64_t h) {
  PairMaskHead<scalar_t> head;
  head.causal = l.causal;
  head.stride_m = l.attn_mask_stride_m, head.stride_n = l.attn_mask_stride_n;
  const int64_t offset = b * l.attn_mask_stride_b + h * l.attn_mask_stride_h;
  if (l.attn_mask != nullptr && l.attn_mask_kind == AttnMaskKind::kBool) {
    head.bool_rows = static_cast<const unsigned char*>(l.attn_mask) + offset;
  } else if (l.attn_mask != nullptr && l.attn_mask_kind == AttnMaskKind::kAdditive) {
    head.additive_rows = static_cast<const scalar_t*>(l.attn_mask) + offset;
  }
  return head;
}

/// The first key past the causal band of query rows [m0, m_end): keys from there on are masked for
/// every row, so the kernels stop their key loop there (N without a causal mask).
__device__ __forceinline__ int64_t causal_key_end(bool causal, int64_t m_end, int64_t N) {
  return causal && m_end < N ? m_end : N;
}

/// The first query row that sees key n0 under a causal mask (0 without one): the backward's dK/dV
/// blocks start their query loop at the tile holding it.
__device__ __forceinline__ int64_t causal_query_begin(bool causal, int64_t n0) { return causal ? n0 : 0; }

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
