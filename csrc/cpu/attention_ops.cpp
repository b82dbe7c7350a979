// The CPU ops of attention: attn_ext::attention_fwd/bwd (masks, causal, grouped heads, dropout) and
// attn_ext::cross_attention_fwd/bwd, its case without any of them. Each checks its arguments with
// the shared checks (csrc/checks/), brings the rows to unit inner stride for the BLAS, and calls the
// one implementation of attention_fwd.cpp / attention_bwd.cpp.
#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "attention_kernels.h"
#include "checks/attention_checks.h"
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

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const std::optional<at::Tensor>& attn_mask,
                                                     const std::optional<at::Tensor>& key_padding_mask, double scale,
                                                     bool is_causal, double dropout_p,
                                                     const std::optional<at::Tensor>& dropout_seed, int64_t chunk_size,
                                                     int64_t window_left, int64_t window_right, int64_t diagonal) {
  check_attention_inputs(q, k, v, attn_mask, key_padding_mask, scale, dropout_p, dropout_seed, chunk_size);
  check_attention_band(window_left, window_right, diagonal);
  return attention_forward(make_call(q, k, v, attn_mask, key_padding_mask, scale,
                                     make_band(is_causal, window_left, window_right, diagonal), dropout_p,
                                     dropout_seed, chunk_size));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
    const at::Tensor& out, const at::Tensor& lse, double scale, bool is_causal, double dropout_p,
    const std::optional<at::Tensor>& dropout_seed, int64_t chunk_size, int64_t window_left, int64_t window_right,
    int64_t diagonal) {
  const AttentionShape s =
      check_attention_inputs(q, k, v, attn_mask, key_padding_mask, scale, dropout_p, dropout_seed, chunk_size);
  check_attention_band(window_left, window_right, diagonal);
  check_attention_grads(s, q, grad_out, grad_lse, out, lse);
  return attention_backward(
      make_call(q, k, v, attn_mask, key_padding_mask, scale, make_band(is_causal, window_left, window_right, diagonal),
                dropout_p, dropout_seed, chunk_size),
      with_unit_inner_stride(grad_out), grad_lse.contiguous(), with_unit_inner_stride(out), lse.contiguous());
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
