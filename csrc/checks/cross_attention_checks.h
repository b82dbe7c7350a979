// Argument checks of the cross-attention and state-merge ops, shared by the CPU ops and the CUDA
// bindings, so that a direct torch.ops.attn_ext call fails with the same messages on every device
// (and as the Python API). Intention reuses the q/k/v checks (intention_checks.h).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <optional>
#include <vector>

#include "checks/common.h"

namespace attn_ext {

/// Sizes of one cross-attention problem (docs/spec.md §0 layout).
struct CrossAttentionShape {
  int64_t batch, heads, queries, keys, head_dim, value_dim;
};

inline CrossAttentionShape check_cross_attention_inputs(const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& v,
                                                        const std::optional<at::Tensor>& key_padding_mask,
                                                        double scale, int64_t chunk_size) {
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
                    "attn_ext: q, k, v must be 4-D [B, H, M, D], [B, H, N, D], [B, H, N, Dv]; got q ",
                    q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK_VALUE(q.size(0) == k.size(0) && k.size(0) == v.size(0) && q.size(1) == k.size(1) &&
                        k.size(1) == v.size(1),
                    "attn_ext: batch and head sizes of q ", q.sizes(), ", k ", k.sizes(), " and v ",
                    v.sizes(), " must match");
  TORCH_CHECK_VALUE(q.size(3) == k.size(3), "attn_ext: q ", q.sizes(), " and k ", k.sizes(),
                    " must have the same head dim D");
  TORCH_CHECK_VALUE(k.size(2) == v.size(2), "attn_ext: k ", k.sizes(), " and v ", v.sizes(),
                    " must have the same number of keys N");
  TORCH_CHECK_TYPE(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
                   "attn_ext: q, k, v must share a dtype; got ", q.scalar_type(), ", ", k.scalar_type(),
                   ", ", v.scalar_type());
  const at::ScalarType dtype = q.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kDouble,
                   "attn_ext: dtype ", dtype, " is not supported; use float16, bfloat16, float32 or float64");
  TORCH_CHECK_VALUE(std::isfinite(scale), "attn_ext: scale must be a finite float, got ", scale);
  TORCH_CHECK(q.device() == k.device() && k.device() == v.device(),
              "attn_ext: q, k, v must be on one device; got ", q.device(), ", ", k.device(), ", ",
              v.device());
  TORCH_CHECK_VALUE(chunk_size > 0, "attn_ext: chunk_size must be positive, got ", chunk_size);
  if (key_padding_mask.has_value()) {
    const at::Tensor& mask = *key_padding_mask;
    TORCH_CHECK_TYPE(mask.scalar_type() == at::kBool,
                     "attn_ext: key_padding_mask must be bool (True = padding), got ", mask.scalar_type());
    TORCH_CHECK_VALUE(mask.dim() == 2 && mask.size(0) == k.size(0) && mask.size(1) == k.size(2),
                      "attn_ext: key_padding_mask must be [B, N] = [", k.size(0), ", ", k.size(2),
                      "], got ", mask.sizes());
    TORCH_CHECK(mask.device() == k.device(), "attn_ext: key_padding_mask is on ", mask.device(),
                " but k is on ", k.device());
  }
  return CrossAttentionShape{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
}

inline void check_cross_attention_grads(const CrossAttentionShape& s, const at::Tensor& q,
                                        const at::Tensor& grad_out, const at::Tensor& grad_lse,
                                        const at::Tensor& out, const at::Tensor& lse) {
  const std::vector<int64_t> out_shape{s.batch, s.heads, s.queries, s.value_dim};
  const std::vector<int64_t> lse_shape{s.batch, s.heads, s.queries};
  TORCH_CHECK_VALUE(out.sizes() == out_shape && grad_out.sizes() == out_shape,
                    "attn_ext: out ", out.sizes(), " and grad_out ", grad_out.sizes(), " must be ",
                    at::IntArrayRef(out_shape));
  TORCH_CHECK_VALUE(lse.sizes() == lse_shape && grad_lse.sizes() == lse_shape, "attn_ext: lse ",
                    lse.sizes(), " and grad_lse ", grad_lse.sizes(), " must be ",
                    at::IntArrayRef(lse_shape));
  TORCH_CHECK_TYPE(out.scalar_type() == q.scalar_type() && grad_out.scalar_type() == q.scalar_type(),
                   "attn_ext: out and grad_out must have q's dtype ", q.scalar_type());
  const auto lse_dtype = accumulation_dtype(q.scalar_type());
  TORCH_CHECK_TYPE(lse.scalar_type() == lse_dtype && grad_lse.scalar_type() == lse_dtype,
                   "attn_ext: lse and grad_lse must be ", lse_dtype, " for ", q.scalar_type(),
                   " inputs; got ", lse.scalar_type(), " and ", grad_lse.scalar_type());
}

/// Rows of the flattened [rows, Dv] state tensors of a merge (attn_ext::merge_states_fwd).
struct MergeStateRows {
  int64_t rows, dv;
};

inline MergeStateRows check_merge_states(const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& out_b,
                                         const at::Tensor& lse_b) {
  TORCH_CHECK_VALUE(out_a.dim() >= 1 && out_a.sizes() == out_b.sizes(), "attn_ext: merged states must have the ",
                    "same out shape; got ", out_a.sizes(), " and ", out_b.sizes());
  TORCH_CHECK_VALUE(lse_a.sizes() == out_a.sizes().slice(0, out_a.dim() - 1) && lse_b.sizes() == lse_a.sizes(),
                    "attn_ext: lse must be out.shape[:-1] = ", out_a.sizes().slice(0, out_a.dim() - 1),
                    "; got ", lse_a.sizes(), " and ", lse_b.sizes());
  TORCH_CHECK_TYPE(out_a.scalar_type() == out_b.scalar_type(), "attn_ext: merged states must share a dtype; got ",
                   out_a.scalar_type(), " and ", out_b.scalar_type());
  const at::ScalarType lse_dtype = accumulation_dtype(out_a.scalar_type());
  TORCH_CHECK_TYPE(lse_a.scalar_type() == lse_dtype && lse_b.scalar_type() == lse_dtype, "attn_ext: lse must be ",
                   lse_dtype, " for ", out_a.scalar_type(), " states; got ", lse_a.scalar_type(), " and ",
                   lse_b.scalar_type());
  TORCH_CHECK(out_a.device() == out_b.device() && lse_a.device() == out_a.device() && lse_b.device() == out_a.device(),
              "attn_ext: merged states must be on one device");
  return MergeStateRows{lse_a.numel(), out_a.size(-1)};
}

/// The merge backward's extra inputs against state a (already checked with check_merge_states).
inline void check_merge_states_grads(const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& out,
                                     const at::Tensor& lse, const at::Tensor& out_a, const at::Tensor& lse_a) {
  TORCH_CHECK_VALUE(grad_out.sizes() == out_a.sizes() && out.sizes() == out_a.sizes() &&
                        grad_lse.sizes() == lse_a.sizes() && lse.sizes() == lse_a.sizes(),
                    "attn_ext: merge backward got grad_out ", grad_out.sizes(), ", grad_lse ", grad_lse.sizes(),
                    ", out ", out.sizes(), ", lse ", lse.sizes(), " for states of shape ", out_a.sizes());
  TORCH_CHECK_TYPE(grad_out.scalar_type() == out_a.scalar_type() && out.scalar_type() == out_a.scalar_type() &&
                       grad_lse.scalar_type() == lse_a.scalar_type() && lse.scalar_type() == lse_a.scalar_type(),
                   "attn_ext: merge backward dtypes must match the states'");
  TORCH_CHECK(grad_out.device() == out_a.device() && grad_lse.device() == out_a.device() &&
                  out.device() == out_a.device() && lse.device() == out_a.device(),
              "attn_ext: merge backward tensors must be on the states' device");
}

}  // namespace attn_ext
