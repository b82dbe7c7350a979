// CPU implementations of the attn_ext::cross_attention_{fwd,bwd} ops (schemas in csrc/ops.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace attn_ext::cpu {

/// Forward: (out [B,H,M,Dv] in q's dtype, lse [B,H,M] in fp32 — fp64 for fp64 inputs).
std::tuple<at::Tensor, at::Tensor> cross_attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v,
                                                          const std::optional<at::Tensor>& key_padding_mask,
                                                          double scale, int64_t chunk_size);

/// Backward: (grad_q, grad_k, grad_v) from the gradients of out and lse and the saved out/lse.
std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_attention_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const std::optional<at::Tensor>& key_padding_mask, const at::Tensor& out,
    const at::Tensor& lse, double scale, int64_t chunk_size);

}  // namespace attn_ext::cpu
