// CPU implementation of attn_ext::intention_fwd / intention_bwd (schemas in csrc/ops.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace attn_ext::cpu {

/// Intention, primal form (SPEC §4): out = scale·Q (KᵀK + αI)⁻¹ KᵀV with alpha [B, H].
/// Returns (out [B,H,M,Dv] in q's dtype, factor L [B,H,D,D] with LLᵀ = KᵀK + αI (lower triangle
/// meaningful), weights W = (KᵀK + αI)⁻¹KᵀV [B,H,D,Dv]); L and W in fp32 (fp64 for fp64 inputs).
/// Without v, C = I: out = scale·Q (KᵀK + αI)⁻¹, the transformed queries of σIntention.
/// A factorisation that fails (α = 0 with a singular Gram matrix) raises ValueError.
std::tuple<at::Tensor, at::Tensor, at::Tensor> intention_fwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                                                 const std::optional<at::Tensor>& v,
                                                                 const std::optional<at::Tensor>& key_padding_mask,
                                                                 const at::Tensor& alpha, double scale);

/// Its backward from the saved L and W: (grad_q, grad_k, grad_v, grad_alpha [B, H]).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> intention_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& key_padding_mask, const at::Tensor& factor, const at::Tensor& weights,
    double scale);

/// σIntention fused (sigma_intention.cpp): out = softmax(scale·Q (KᵀK + αI)⁻¹ Kᵀ) V over the
/// valid keys. Returns (out [B,H,M,Dv], lse [B,H,M], q_tilde = scale·Q (KᵀK + αI)⁻¹ [B,H,M,D] in q's
/// dtype, factor L [B,H,D,D], weights (KᵀK + αI)⁻¹ [B,H,D,D]): exactly what intention_fwd(v=None)
/// followed by cross_attention_fwd(q_tilde, k, v, scale=1) return, for their backwards.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> sigma_intention_fwd_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& key_padding_mask,
    const at::Tensor& alpha, double scale, int64_t chunk_size);

}  // namespace attn_ext::cpu
