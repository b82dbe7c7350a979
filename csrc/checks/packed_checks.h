// Argument checks of a packed (varlen) attention call (cu_seqlens_q/k, attn_ext.varlen_attention's layout
// q [1, H, total_q, D], k and v [1, Hkv, total_k, ·]), shared by the CPU op and the CUDA binding so that both
// refuse the same calls with the same messages.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace attn_ext {

/// A packed call's sequence offsets, read to the host and checked.
struct PackedOffsets {
  std::vector<int32_t> q, k;  ///< [S + 1] each
  int64_t max_q = 0, max_k = 0;  ///< the longest sequence's queries and keys

  int64_t sequences() const { return static_cast<int64_t>(q.size()) - 1; }
};

/// Checks a packed call's offsets and what a packed call refuses (dropout, a diagonal, attn_mask or key padding):
/// int32 [S + 1] each, from 0, non-decreasing, ending at q's and k's packed rows.
inline PackedOffsets check_packed_offsets(const at::Tensor& q, const at::Tensor& k,
                                          const std::optional<at::Tensor>& cu_q_t,
                                          const std::optional<at::Tensor>& cu_k_t, int64_t diagonal,
                                          const std::optional<at::Tensor>& attn_mask,
                                          const std::optional<at::Tensor>& key_padding_mask, double dropout_p) {
  const char* who = "attn_ext.varlen_attention";
  TORCH_CHECK_VALUE(!(dropout_p > 0), who, ": a packed batch takes no dropout here (ae.varlen_attention runs "
                    "dropout one sequence at a time)");
  TORCH_CHECK_VALUE(cu_q_t.has_value() && cu_k_t.has_value(), who, ": cu_seqlens_q and cu_seqlens_k come together");
  TORCH_CHECK_VALUE(q.size(0) == 1, who, ": a packed batch is q [1, H, total_q, D], got ", q.sizes());
  TORCH_CHECK_VALUE(diagonal == 0, who, ": the diagonal of a packed batch is per sequence (bottom_right), got ",
                    diagonal);
  TORCH_CHECK_VALUE(!attn_mask.has_value() && !key_padding_mask.has_value(), who,
                    ": a packed batch takes no attn_mask or key padding mask");
  for (const at::Tensor* cu : {&*cu_q_t, &*cu_k_t}) {
    TORCH_CHECK_TYPE(cu->scalar_type() == at::kInt && cu->dim() == 1 && cu->numel() >= 1, who,
                     ": cu_seqlens must be int32 [S + 1], got ", cu->scalar_type(), " ", cu->sizes());
  }
  TORCH_CHECK_VALUE(cu_q_t->numel() == cu_k_t->numel(), who, ": cu_seqlens_q ", cu_q_t->sizes(),
                    " and cu_seqlens_k ", cu_k_t->sizes(), " must describe the same sequences");
  const at::Tensor cu_q = cu_q_t->cpu().contiguous(), cu_k = cu_k_t->cpu().contiguous();
  PackedOffsets offsets;
  offsets.q.assign(cu_q.const_data_ptr<int32_t>(), cu_q.const_data_ptr<int32_t>() + cu_q.numel());
  offsets.k.assign(cu_k.const_data_ptr<int32_t>(), cu_k.const_data_ptr<int32_t>() + cu_k.numel());
  const int64_t n = offsets.sequences();
  TORCH_CHECK_VALUE(offsets.q[0] == 0 && offsets.k[0] == 0 && offsets.q[n] == q.size(2) && offsets.k[n] == k.size(2),
                    who, ": cu_seqlens must start at 0 and end at the packed rows (", q.size(2), " queries, ",
                    k.size(2), " keys)");
  for (int64_t s = 0; s < n; ++s) {
    TORCH_CHECK_VALUE(offsets.q[s + 1] >= offsets.q[s] && offsets.k[s + 1] >= offsets.k[s], who,
                      ": cu_seqlens must not decrease");
    offsets.max_q = std::max<int64_t>(offsets.max_q, offsets.q[s + 1] - offsets.q[s]);
    offsets.max_k = std::max<int64_t>(offsets.max_k, offsets.k[s + 1] - offsets.k[s]);
  }
  return offsets;
}

}  // namespace attn_ext
