// The score rules of an emulation case: a band (a sliding window or a causal rule off the top-left diagonal),
// a soft cap and ALiBi, set on the kernels' AttentionMaskLayout as the bindings set them, and their double
// reference. Used by the forward and backward cases (cuda_fwd_emulation_case.h,
// cuda_attention_bwd_emulation_case.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "common/attention_mask.h"

namespace emulation_rules {

using attn_ext::cuda::kBandUnbounded;

struct ScoreRules {
  int64_t band_lo = -kBandUnbounded, band_hi = kBandUnbounded;  ///< key n for query m iff m + lo <= n <= m + hi
  int64_t diagonal = 0;                                         ///< ALiBi's distance |m + diagonal − n|
  float softcap = 0;                                            ///< c > 0: s = c·tanh(s / c)
  float alibi = 0;  ///< ALiBi: query head h's slope is alibi·(h + 1), the same for every batch entry (0: none)

  bool any() const {
    return band_lo != -kBandUnbounded || band_hi != kBandUnbounded || softcap > 0 || alibi != 0;
  }
  bool in_band(int64_t m, int64_t n) const { return n >= m + band_lo && n <= m + band_hi; }
  double slope(int64_t h) const { return double(alibi) * double(h + 1); }

  /// Sets the layout's rules; `slopes` receives the [H] slopes, read as [B, H] with a batch stride of 0.
  void apply(attn_ext::cuda::AttentionMaskLayout& p, int64_t H, std::vector<float>& slopes) const {
    p.band_lo = band_lo, p.band_hi = band_hi, p.diagonal = diagonal, p.softcap = softcap;
    p.softcap_inverse = softcap > 0 ? 1.0f / softcap : 0.0f;
    if (alibi == 0) return;
    slopes.resize(H);
    for (int64_t h = 0; h < H; ++h) slopes[h] = static_cast<float>(slope(h));
    p.alibi_slopes = slopes.data(), p.alibi_stride_b = 0, p.alibi_stride_h = 1;
  }

  /// An allowed pair's score from its scaled dot product and its additive mask term.
  double score(double scaled, double additive, int64_t h, int64_t m, int64_t n) const {
    if (softcap > 0) scaled = double(softcap) * std::tanh(scaled / double(softcap));
    return scaled + additive - slope(h) * double(std::llabs(m + diagonal - n));
  }
  /// d score / d (scaled dot product): the soft cap's 1 − tanh², else 1.
  double score_slope(double scaled) const {
    if (!(softcap > 0)) return 1.0;
    const double t = std::tanh(scaled / double(softcap));
    return 1.0 - t * t;
  }
};

}  // namespace emulation_rules
