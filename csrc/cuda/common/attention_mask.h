// What the attention op (attention_fwd / attention_bwd) adds to the cross-attention kernels' arguments:
// per-pair masks (a causal mask, a band: sliding window or offset causal rule, and an attn_mask read
// through its strides), the score modifications (soft cap, ALiBi) and grouped-query heads.
// The params structs derive from it next to QkvLayout; cross_attention_fwd/bwd leave it at its
// defaults (no pair mask, one query head per key/value head), which selects their original kernels.
//
// Plain C++ (no CUDA headers), like the plans; the predicates are host and device functions.
#pragma once

#include <cstdint>

#include "attn_ext/macros.h"  // ATTN_EXT_HOST_DEVICE: the kernels ask these too

namespace attn_ext {
namespace cuda {

/// A side of a band without a limit: far beyond any index difference, and far from int64's ends (as the CPU
/// kernels' Band).
constexpr int64_t kBandUnbounded = int64_t(1) << 62;

/// How attn_mask's elements read: bool (one byte, nonzero = the pair takes part, as SDPA's) or
/// additive (the kernels' dtype, added to the scaled score; −inf masks the pair like false).
enum class AttnMaskKind : uint8_t { kNone = 0, kBool = 1, kAdditive = 2 };

struct AttentionMaskLayout {
  /// [B, H, M, N] view (H = query heads) with free element strides, 0 for broadcast dims; null = none.
  const void* attn_mask = nullptr;
  AttnMaskKind attn_mask_kind = AttnMaskKind::kNone;
  int64_t attn_mask_stride_b = 0, attn_mask_stride_h = 0, attn_mask_stride_m = 0, attn_mask_stride_n = 0;
  /// Top-left causal: query m sees key n iff n <= m (whatever M and N are). The kernels split their key
  /// loops at this diagonal (tiles below it need no per-pair test).
  bool causal = false;
  /// Any other band: key n takes part for query m only if m + band_lo <= n <= m + band_hi (a sliding window
  /// about the diagonal key m + diagonal, a causal rule off the top-left diagonal); kBandUnbounded: no limit
  /// on that side. Key tiles wholly outside it are never visited; the others test each pair.
  int64_t band_lo = -kBandUnbounded, band_hi = kBandUnbounded;
  /// Query m's diagonal key m + diagonal: ALiBi's distance |m + diagonal - n|.
  int64_t diagonal = 0;
  /// c > 0: an allowed pair's scaled dot product s becomes c * tanh(s / c) before its additive terms; 0: none.
  /// softcap_inverse = 1 / c (the kernels multiply: a division is a subroutine call in device code).
  float softcap = 0, softcap_inverse = 0;
  /// ALiBi, fp32 [B, H] slopes read through their strides (0 for a broadcast dim), or null: an allowed pair's
  /// score gets - slope * |m + diagonal - n|.
  const float* alibi_slopes = nullptr;
  int64_t alibi_stride_b = 0, alibi_stride_h = 0;
  /// Query heads per key/value head (GQA): query head h reads k/v head h / kv_group; k, v (and grad_k,
  /// grad_v) have H / kv_group heads. 1 = ordinary multi-head attention.
  int64_t kv_group = 1;

  ATTN_EXT_HOST_DEVICE constexpr bool has_band() const {
    return band_lo != -kBandUnbounded || band_hi != kBandUnbounded;
  }
  ATTN_EXT_HOST_DEVICE constexpr bool modifies_scores() const { return softcap > 0 || alibi_slopes != nullptr; }
  /// Whether the kernels must take the instantiations that read per-pair masks.
  ATTN_EXT_HOST_DEVICE constexpr bool has_pair_masks() const {
    return causal || attn_mask != nullptr || has_band() || modifies_scores();
  }
  /// Whether every visited key tile reads the per-pair rules (only the top-left causal rule alone leaves
  /// tiles below its diagonal to the plain path).
  ATTN_EXT_HOST_DEVICE constexpr bool every_tile_per_pair() const {
    return attn_mask != nullptr || has_band() || modifies_scores();
  }
};

}  // namespace cuda
}  // namespace attn_ext
