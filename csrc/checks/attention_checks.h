// Argument checks of the attention ops, shared by the CPU ops and the CUDA bindings so that a direct
// torch.ops.attn_ext call fails with the same messages on every device (and as the Python API):
// attn_ext::attention_fwd/bwd (scaled dot-product attention with masks, causal, grouped heads and
// dropout), attn_ext::cross_attention_fwd/bwd (its case without any of them: Hq = Hkv heads, messages
// in the cross-attention layout [B, H, M, D]) and the state merge. Intention reuses the cross-attention
// q/k/v checks (intention_checks.h). Every message names the op and the shapes it got.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <optional>
#include <vector>

#include "checks/common.h"

namespace attn_ext {

namespace detail {

/// What the attention and cross-attention checks ask alike once q, k, v are 4-D with matching batch
/// sizes and heads: head dims, key counts, dtypes, scale, devices and chunk_size. `who` opens every
/// message ("attn_ext.attention" or "attn_ext") and `keys` names the key count as its layout does.
inline void check_qkv_alike(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                            int64_t chunk_size, const char* who, const char* keys) {
  TORCH_CHECK_VALUE(q.size(3) == k.size(3), who, ": q ", q.sizes(), " and k ", k.sizes(),
                    " must have the same head dim D");
  TORCH_CHECK_VALUE(k.size(2) == v.size(2), who, ": k ", k.sizes(), " and v ", v.sizes(),
                    " must have the same number of keys ", keys);
  TORCH_CHECK_TYPE(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), who,
                   ": q, k, v must share a dtype; got ", q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type());
  const at::ScalarType dtype = q.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kDouble, who,
                   ": dtype ", dtype, " is not supported; use float16, bfloat16, float32 or float64");
  TORCH_CHECK_VALUE(std::isfinite(scale), who, ": scale must be a finite float, got ", scale);
  TORCH_CHECK(q.device() == k.device() && k.device() == v.device(), who, ": q, k, v must be on one device; got ",
              q.device(), ", ", k.device(), ", ", v.device());
  TORCH_CHECK_VALUE(chunk_size > 0, who, ": chunk_size must be positive, got ", chunk_size);
}

/// key_padding_mask, when given: bool [B, keys] on k's device (k [B, H, keys, D] checked).
inline void check_key_padding_mask(const std::optional<at::Tensor>& key_padding_mask, const at::Tensor& k,
                                   const char* who, const char* keys) {
  if (!key_padding_mask.has_value()) return;
  const at::Tensor& mask = *key_padding_mask;
  TORCH_CHECK_TYPE(mask.scalar_type() == at::kBool, who, ": key_padding_mask must be bool (True = padding), got ",
                   mask.scalar_type());
  TORCH_CHECK_VALUE(mask.dim() == 2 && mask.size(0) == k.size(0) && mask.size(1) == k.size(2), who,
                    ": key_padding_mask must be [B, ", keys, "] = [", k.size(0), ", ", k.size(2), "], got ",
                    mask.sizes());
  TORCH_CHECK(mask.device() == k.device(), who, ": key_padding_mask is on ", mask.device(), " but k is on ",
              k.device());
}

}  // namespace detail

// ---- attention (scaled dot-product)

/// Sizes of one attention problem: q [B, Hq, L, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv].
struct AttentionShape {
  int64_t batch, q_heads, kv_heads, queries, keys, head_dim, value_dim;
};

inline AttentionShape check_attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const std::optional<at::Tensor>& attn_mask,
                                             const std::optional<at::Tensor>& key_padding_mask, double scale,
                                             double dropout_p, const std::optional<at::Tensor>& dropout_seed,
                                             int64_t chunk_size) {
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
                    "attn_ext.attention: q, k, v must be 4-D [B, Hq, L, D], [B, Hkv, S, D], [B, Hkv, S, Dv]; got q ",
                    q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK_VALUE(q.size(0) == k.size(0) && k.size(0) == v.size(0) && k.size(1) == v.size(1),
                    "attn_ext.attention: batch sizes of q ", q.sizes(), ", k ", k.sizes(), " and v ", v.sizes(),
                    " and head counts of k and v must match");
  // Hq = Hkv = 0 is an empty problem (empty results); Hkv = 0 under Hq > 0 heads would leave them no keys.
  TORCH_CHECK_VALUE(k.size(1) > 0 ? q.size(1) % k.size(1) == 0 : q.size(1) == 0,
                    "attn_ext.attention: q's heads Hq = ", q.size(1),
                    " must be a multiple of k's and v's heads Hkv = ", k.size(1), " (grouped-query attention); got q ",
                    q.sizes(), ", k ", k.sizes());
  detail::check_qkv_alike(q, k, v, scale, chunk_size, "attn_ext.attention", "S");
  const at::ScalarType dtype = q.scalar_type();
  const int64_t B = q.size(0), Hq = q.size(1), L = q.size(2), S = k.size(2);
  if (attn_mask.has_value()) {
    const at::Tensor& mask = *attn_mask;
    TORCH_CHECK_TYPE(mask.scalar_type() == at::kBool || mask.scalar_type() == dtype,
                     "attn_ext.attention: attn_mask must be bool (True = take part) or q's dtype ", dtype,
                     " (added to the scores); got ", mask.scalar_type());
    TORCH_CHECK_VALUE(mask.dim() == 4 && mask.size(0) == B && mask.size(1) == Hq && mask.size(2) == L &&
                          mask.size(3) == S,
                      "attn_ext.attention: attn_mask must be [B, Hq, L, S] = [", B, ", ", Hq, ", ", L, ", ", S,
                      "] (expand a broadcastable mask to it); got ", mask.sizes());
    TORCH_CHECK(mask.device() == q.device(), "attn_ext.attention: attn_mask is on ", mask.device(),
                " but q is on ", q.device());
  }
  detail::check_key_padding_mask(key_padding_mask, k, "attn_ext.attention", "S");
  TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p < 1.0, "attn_ext.attention: dropout_p must be in [0, 1), got ",
                    dropout_p);
  if (dropout_p > 0.0) {
    TORCH_CHECK_VALUE(dropout_seed.has_value(), "attn_ext.attention: dropout_p = ", dropout_p,
                      " > 0 needs a dropout_seed (an int64 tensor with one element)");
    TORCH_CHECK_TYPE(dropout_seed->scalar_type() == at::kLong && dropout_seed->numel() == 1,
                     "attn_ext.attention: dropout_seed must be an int64 tensor with one element; got ",
                     dropout_seed->scalar_type(), " of shape ", dropout_seed->sizes());
  }
  return AttentionShape{B, Hq, k.size(1), L, S, q.size(3), v.size(3)};
}

/// The band arguments of attention_fwd/bwd: each window side -1 (unbounded) or a key count >= 0; the diagonal
/// offset |diagonal| below 2^61 (the kernels add it to row indices in int64).
inline void check_attention_band(int64_t window_left, int64_t window_right, int64_t diagonal) {
  TORCH_CHECK_VALUE(window_left >= -1 && window_right >= -1, "attn_ext.scaled_dot_product_attention: window_size = (",
                    window_left, ", ", window_right, ") must be keys before and after the diagonal, >= 0, or -1 for "
                    "no limit on that side");
  TORCH_CHECK_VALUE(diagonal > -(int64_t(1) << 61) && diagonal < (int64_t(1) << 61),
                    "attn_ext.scaled_dot_product_attention: diagonal offset ", diagonal, " is out of range");
}

/// The score modifications of attention_fwd/bwd: softcap 0 (none) or a finite c > 0; alibi_slopes absent or a
/// float32 [B, Hq] tensor of finite slopes on q's device.
inline void check_score_mods(const AttentionShape& s, const at::Tensor& q, double softcap,
                             const std::optional<at::Tensor>& alibi_slopes) {
  TORCH_CHECK_VALUE(softcap == 0 || (std::isfinite(softcap) && softcap > 0),
                    "attn_ext.scaled_dot_product_attention: softcap must be a finite float > 0 (or 0: none), got ",
                    softcap);
  if (!alibi_slopes.has_value()) return;
  const at::Tensor& a = *alibi_slopes;
  TORCH_CHECK_TYPE(a.scalar_type() == at::kFloat, "attn_ext.scaled_dot_product_attention: alibi_slopes must be "
                   "float32, got ", a.scalar_type());
  TORCH_CHECK_VALUE(a.dim() == 2 && a.size(0) == s.batch && a.size(1) == s.q_heads,
                    "attn_ext.scaled_dot_product_attention: alibi_slopes must be [B, Hq] = [", s.batch, ", ",
                    s.q_heads, "], got ", a.sizes());
  TORCH_CHECK_VALUE(a.device() == q.device(), "attn_ext.scaled_dot_product_attention: alibi_slopes is on ",
                    a.device(), " but q is on ", q.device());
}

/// The backward's extra inputs: grad_out and out [B, Hq, L, Dv] in q's dtype, grad_lse and lse
/// [B, Hq, L] in the accumulation dtype.
inline void check_attention_grads(const AttentionShape& s, const at::Tensor& q, const at::Tensor& grad_out,
                                  const at::Tensor& grad_lse, const at::Tensor& out, const at::Tensor& lse) {
  const std::vector<int64_t> out_shape{s.batch, s.q_heads, s.queries, s.value_dim};
  const std::vector<int64_t> lse_shape{s.batch, s.q_heads, s.queries};
  TORCH_CHECK_VALUE(out.sizes() == out_shape && grad_out.sizes() == out_shape, "attn_ext.attention: out ",
                    out.sizes(), " and grad_out ", grad_out.sizes(), " must be [B, Hq, L, Dv] = ",
                    at::IntArrayRef(out_shape));
  TORCH_CHECK_VALUE(lse.sizes() == lse_shape && grad_lse.sizes() == lse_shape, "attn_ext.attention: lse ",
                    lse.sizes(), " and grad_lse ", grad_lse.sizes(), " must be [B, Hq, L] = ",
                    at::IntArrayRef(lse_shape));
  TORCH_CHECK_TYPE(out.scalar_type() == q.scalar_type() && grad_out.scalar_type() == q.scalar_type(),
                   "attn_ext.attention: out and grad_out must have q's dtype ", q.scalar_type(), "; got ",
                   out.scalar_type(), " and ", grad_out.scalar_type());
  const auto lse_dtype = accumulation_dtype(q.scalar_type());
  TORCH_CHECK_TYPE(lse.scalar_type() == lse_dtype && grad_lse.scalar_type() == lse_dtype,
                   "attn_ext.attention: lse and grad_lse must be ", lse_dtype, " for ", q.scalar_type(),
                   " inputs; got ", lse.scalar_type(), " and ", grad_lse.scalar_type());
  TORCH_CHECK(out.device() == q.device() && grad_out.device() == q.device() && lse.device() == q.device() &&
                  grad_lse.device() == q.device(),
              "attn_ext.attention: out, lse and their gradients must be on q's device ", q.device());
}

// ---- cross attention: q [B, H, M, D], k [B, H, N, D], v [B, H, N, Dv], key padding only

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
  detail::check_qkv_alike(q, k, v, scale, chunk_size, "attn_ext", "N");
  detail::check_key_padding_mask(key_padding_mask, k, "attn_ext", "N");
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

// ---- state merge

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
