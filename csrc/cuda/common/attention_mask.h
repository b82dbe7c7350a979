// What the attention op (attention_fwd / attention_bwd) adds to the cross-attention kernels' arguments:
// per-pair masks (a causal mask, and an attn_mask read through its strides) and grouped-query heads.
// The params structs derive from it next to QkvLayout; cross_attention_fwd/bwd leave it at its
// defaults (no pair mask, one query head per key/value head), which selects their original kernels.
//
// Plain C++ (no CUDA headers), like the plans.
#pragma once

#include <cstdint>

namespace attn_ext {
namespace cuda {

/// How attn_mask's elements read: bool (one byte, nonzero = the pair takes part, as SDPA's) or
/// additive (the kernels' dtype, added to the scaled score; −inf masks the pair like false).
enum class AttnMaskKind : uint8_t { kNone = 0, kBool = 1, kAdditive = 2 };

struct AttentionMaskLayout {
  /// [B, H, M, N] view (H = query heads) with free element strides, 0 for broadcast dims; null = none.
  const void* attn_mask = nullptr;
  AttnMaskKind attn_mask_kind = AttnMaskKind::kNone;
  int64_t attn_mask_stride_b = 0, attn_mask_stride_h = 0, attn_mask_stride_m = 0, attn_mask_stride_n = 0;
  /// Top-left causal: query m sees key n iff n <= m (whatever M and N are).
  bool causal = false;
  /// Query heads per key/value head (GQA): query head h reads k/v head h / kv_group; k, v (and grad_k,
  /// grad_v) have H / kv_group heads. 1 = ordinary multi-head attention.
  int64_t kv_group = 1;

  /// Whether the kernels must take the instantiations that read per-pair masks.
  constexpr bool has_pair_masks() const { return causal || attn_mask != nullptr; }
};

}  // namespace cuda
}  // namespace attn_ext
