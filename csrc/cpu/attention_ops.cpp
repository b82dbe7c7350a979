// The CPU ops of attention: attn_ext::attention_fwd/bwd (masks, causal, grouped heads, dropout) and
// attn_ext::cross_attention_fwd/bwd, its case without any of them. Each checks its arguments with
// the shared checks (csrc/checks/), brings the rows to unit inner stride for the BLAS, and calls the
// one implementation of attention_fwd.cpp / attention_bwd.cpp.
#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "attention_kernels.h"
#include "checks/attention_checks.h"
#include "checks/packed_checks.h"
#include "ops.h"

namespace attn_ext::cpu {
namespace {

AttentionCall make_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
                        double scale, Band band, double dropout_p, const std::optional<at::Tensor>& dropout_seed,
                        int64_t chunk_size) {
  TORCH_CHECK(q.device().is_cpu(), "attn_ext: the CPU kernel got tensors on ", q.device());
  AttentionCall call{with_unit_inner_stride(q), with_unit_inner_stride(k), with_unit_inner_stride(v), at::Tensor(),
                     at::Tensor(), scale, band, dropout_p, 0, chunk_size};
  // The mask is read through its strides (broadcast dims stay stride 0): never copied.
  if (attn_mask.has_value()) call.attn_mask = *attn_mask;
  if (key_padding_mask.has_value()) call.padding = key_padding_mask->contiguous();
  if (dropout_p > 0) call.seed = dropout_seed->item<int64_t>();
  return call;
}

/// A packed batch's segments (one per sequence of cu_seqlens_q/k, int32 [S + 1]): checked, each with its band
/// (the sequence's own, aligned top-left or at the end of its keys) shifted into the packed rows' numbering.
std::vector<Segment> packed_segments(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& cu_q_t,
                                     const std::optional<at::Tensor>& cu_k_t, bool causal, int64_t window_left,
                                     int64_t window_right, int64_t diagonal, bool bottom_right,
                                     const std::optional<at::Tensor>& attn_mask,
                                     const std::optional<at::Tensor>& key_padding_mask, double dropout_p) {
  const PackedOffsets offsets =
      check_packed_offsets(q, k, cu_q_t, cu_k_t, diagonal, attn_mask, key_padding_mask, dropout_p);
  const int32_t* oq = offsets.q.data();
  const int32_t* ok = offsets.k.data();
  const int64_t n = offsets.sequences();
  std::vector<Segment> segments;
  for (int64_t s = 0; s < n; ++s) {
    const int64_t L = oq[s + 1] - oq[s], S = ok[s + 1] - ok[s], shift = ok[s] - oq[s];
    const int64_t diag = bottom_right ? S - L : 0;
    Band band = make_band(causal, window_left, window_right, diag);
    if (band.lo != -kBandUnbounded) band.lo += shift;
    if (band.hi != kBandUnbounded) band.hi += shift;
    segments.push_back(Segment{0, oq[s], oq[s + 1], ok[s], ok[s + 1], band, diag + shift});
  }
  return segments;
}

/// The soft cap and ALiBi slopes (contiguous fp32 [B, Hq]) of a checked call.
void with_score_mods(AttentionCall& call, int64_t diagonal, double softcap,
                     const std::optional<at::Tensor>& alibi_slopes) {
  call.softcap = softcap;
  call.diagonal = diagonal;
  if (alibi_slopes.has_value()) call.alibi = alibi_slopes->contiguous();
}

/// The checked call of attention_fwd/bwd's arguments (a packed batch's segments included).
AttentionCall checked_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const std::optional<at::Tensor>& attn_mask,
                           const std::optional<at::Tensor>& key_padding_mask, double scale, bool is_causal,
                           double dropout_p, const std::optional<at::Tensor>& dropout_seed, int64_t chunk_size,
                           int64_t window_left, int64_t window_right, int64_t diagonal, double softcap,
                           const std::optional<at::Tensor>& alibi_slopes,
                           const std::optional<at::Tensor>& cu_seqlens_q,
                           const std::optional<at::Tensor>& cu_seqlens_k, bool bottom_right) {
  AttentionShape s =
      check_attention_inputs(q, k, v, attn_mask, key_padding_mask, scale, dropout_p, dropout_seed, chunk_size);
  check_attention_band(window_left, window_right, diagonal);
  std::vector<Segment> packed;
  if (cu_seqlens_q.has_value() || cu_seqlens_k.has_value()) {
    packed = packed_segments(q, k, cu_seqlens_q, cu_seqlens_k, is_causal, window_left, window_right, diagonal,
                             bottom_right, attn_mask, key_padding_mask, dropout_p);
    s.batch = static_cast<int64_t>(packed.size());  // ALiBi's slopes are per sequence
  } else {
    TORCH_CHECK_VALUE(!bottom_right, "attn_ext.scaled_dot_product_attention: bottom_right is a packed batch's "
                      "alignment; pass the diagonal offset");
  }
  check_score_mods(s, q, softcap, alibi_slopes);
  AttentionCall call = make_call(q, k, v, attn_mask, key_padding_mask, scale,
                                 make_band(is_causal, window_left, window_right, diagonal), dropout_p, dropout_seed,
                                 chunk_size);
  with_score_mods(call, diagonal, softcap, alibi_slopes);
  call.packed = std::move(packed);
  return call;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const std::optional<at::Tensor>& attn_mask,
                                                     const std::optional<at::Tensor>& key_padding_mask, double scale,
                                                     bool is_causal, double dropout_p,
                                                     const std::optional<at::Tensor>& dropout_seed, int64_t chunk_size,
                                                     int64_t window_left, int64_t window_right, int64_t diagonal,
                                                     double softcap, const std::optional<at::Tensor>& alibi_slopes,
                                                     const std::optional<at::Tensor>& cu_seqlens_q,
                                                     const std::optional<at::Tensor>& cu_seqlens_k, bool bottom_right) {
  return attention_forward(checked_call(q, k, v, attn_mask, key_padding_mask, scale, is_causal, dropout_p,
                                        dropout_seed, chunk_size, window_left, window_right, diagonal, softcap,
                                        alibi_slopes, cu_seqlens_q, cu_seqlens_k, bottom_right));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
    const at::Tensor& out, const at::Tensor& lse, double scale, bool is_causal, double dropout_p,
    const std::optional<at::Tensor>& dropout_seed, int64_t chunk_size, int64_t window_left, int64_t window_right,
    int64_t diagonal, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k, bool bottom_right) {
  const AttentionCall call = checked_call(q, k, v, attn_mask, key_padding_mask, scale, is_causal, dropout_p,
                                          dropout_seed, chunk_size, window_left, window_right, diagonal, softcap,
                                          alibi_slopes, cu_seqlens_q, cu_seqlens_k, bottom_right);
  const AttentionShape s =
      check_attention_inputs(q, k, v, attn_mask, key_padding_mask, scale, dropout_p, dropout_seed, chunk_size);
  check_attention_grads(s, q, grad_out, grad_lse, out, lse);
  return attention_backward(call,
      with_unit_inner_stride(grad_out), grad_lse.contiguous(), with_unit_inner_stride(out), lse.contiguous());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_bwd_bias_cpu(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
    const at::Tensor& out, const at::Tensor& lse, double scale, bool is_causal, double dropout_p,
    const std::optional<at::Tensor>& dropout_seed, int64_t chunk_size, int64_t window_left, int64_t window_right,
    int64_t diagonal, double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  TORCH_CHECK_TYPE(attn_mask.is_floating_point(), "attn_ext::attention_bwd_bias: the gradient is of an additive "
                   "(float) attn_mask; got ", attn_mask.scalar_type());
  const AttentionCall call = checked_call(q, k, v, attn_mask, key_padding_mask, scale, is_causal, dropout_p,
                                          dropout_seed, chunk_size, window_left, window_right, diagonal, softcap,
                                          alibi_slopes, std::nullopt, std::nullopt, false);
  const AttentionShape s =
      check_attention_inputs(q, k, v, attn_mask, key_padding_mask, scale, dropout_p, dropout_seed, chunk_size);
  check_attention_grads(s, q, grad_out, grad_lse, out, lse);
  at::Tensor grad_mask;
  auto [grad_q, grad_k, grad_v] = attention_backward(call, with_unit_inner_stride(grad_out), grad_lse.contiguous(),
                                                     with_unit_inner_stride(out), lse.contiguous(), &grad_mask);
  return {grad_q, grad_k, grad_v, grad_mask};
}

std::tuple<at::Tensor, at::Tensor> paged_attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                                                           const at::Tensor& v_cache, const at::Tensor& block_table,
                                                           const at::Tensor& cache_seqlens, double scale,
                                                           bool is_causal, int64_t window_left, int64_t window_right,
                                                           double softcap,
                                                           const std::optional<at::Tensor>& alibi_slopes,
                                                           int64_t chunk_size) {
  const char* who = "attn_ext.paged_attention";
  TORCH_CHECK(q.device().is_cpu(), "attn_ext: the CPU kernel got tensors on ", q.device());
  TORCH_CHECK_VALUE(q.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4, who, ": q [B, Hq, M, D], k_cache and "
                    "v_cache [num_blocks, block_size, Hkv, ·]; got ", q.sizes(), ", ", k_cache.sizes(), ", ",
                    v_cache.sizes());
  TORCH_CHECK_TYPE(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(), who,
                   ": q, k_cache, v_cache must share a dtype");
  const int64_t B = q.size(0), Hq = q.size(1), M = q.size(2), bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK_VALUE(k_cache.sizes().slice(0, 3) == v_cache.sizes().slice(0, 3) && k_cache.size(3) == q.size(3) &&
                    q.size(3) > 0 && bs > 0 && Hkv > 0 && Hq % Hkv == 0, who, ": q ", q.sizes(), ", k_cache ",
                    k_cache.sizes(), " and v_cache ", v_cache.sizes(), " do not fit together");
  TORCH_CHECK_TYPE(block_table.scalar_type() == at::kInt && cache_seqlens.scalar_type() == at::kInt, who,
                   ": block_table and cache_seqlens must be int32");
  TORCH_CHECK_VALUE(block_table.dim() == 2 && block_table.size(0) == B && cache_seqlens.dim() == 1 &&
                    cache_seqlens.size(0) == B, who, ": block_table [B, max_blocks] and cache_seqlens [B] for B = ",
                    B, ", got ", block_table.sizes(), " and ", cache_seqlens.sizes());
  check_attention_band(window_left, window_right, 0);
  TORCH_CHECK_VALUE(chunk_size > 0, who, ": chunk_size must be positive");
  const at::Tensor table = block_table.contiguous(), lengths_t = cache_seqlens.contiguous();
  const int32_t* lengths = lengths_t.const_data_ptr<int32_t>();
  const int32_t* blocks = table.const_data_ptr<int32_t>();
  const int64_t capacity = table.size(1) * bs, num_blocks = k_cache.size(0);
  std::vector<Segment> segments;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = lengths[b];
    TORCH_CHECK_VALUE(n >= 0 && n <= capacity, who, ": cache_seqlens[", b, "] = ", n, " is outside [0, ", capacity,
                      "]");
    for (int64_t i = 0; i < (n + bs - 1) / bs; ++i) {
      TORCH_CHECK_VALUE(blocks[b * table.size(1) + i] >= 0 && blocks[b * table.size(1) + i] < num_blocks, who,
                        ": block_table[", b, ", ", i, "] = ", blocks[b * table.size(1) + i], " is outside [0, ",
                        num_blocks, ")");
    }
    // The M queries are the entry's last M positions: aligned bottom-right, the diagonal n − M.
    segments.push_back(Segment{b, 0, M, 0, n, make_band(is_causal, window_left, window_right, n - M), n - M});
  }
  AttentionShape s{B, Hq, Hkv, M, capacity, q.size(3), v_cache.size(3)};
  check_score_mods(s, q, softcap, alibi_slopes);
  AttentionCall call{with_unit_inner_stride(q), with_unit_inner_stride(k_cache), with_unit_inner_stride(v_cache),
                     at::Tensor(), at::Tensor(), scale, make_band(is_causal, window_left, window_right, 0), 0.0, 0,
                     chunk_size};
  with_score_mods(call, 0, softcap, alibi_slopes);
  call.packed = std::move(segments);
  call.block_table = table;
  call.op = who;
  return attention_forward(call);
}

std::tuple<at::Tensor, at::Tensor> cross_attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v,
                                                          const std::optional<at::Tensor>& key_padding_mask,
                                                          double scale, int64_t chunk_size) {
  check_cross_attention_inputs(q, k, v, key_padding_mask, scale, chunk_size);
  AttentionCall call = make_call(q, k, v, std::nullopt, key_padding_mask, scale, Band{}, 0.0, std::nullopt, chunk_size);
  call.op = "attn_ext.cross_attention";
  return attention_forward(call);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_attention_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const std::optional<at::Tensor>& key_padding_mask, const at::Tensor& out,
    const at::Tensor& lse, double scale, int64_t chunk_size) {
  const CrossAttentionShape s = check_cross_attention_inputs(q, k, v, key_padding_mask, scale, chunk_size);
  check_cross_attention_grads(s, q, grad_out, grad_lse, out, lse);
  return attention_backward(
      make_call(q, k, v, std::nullopt, key_padding_mask, scale, Band{}, 0.0, std::nullopt, chunk_size),
      with_unit_inner_stride(grad_out), grad_lse.contiguous(), with_unit_inner_stride(out), lse.contiguous());
}

}  // namespace attn_ext::cpu
