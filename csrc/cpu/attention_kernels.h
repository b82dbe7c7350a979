// The CPU attention kernels behind attn_ext::attention_fwd/bwd and attn_ext::cross_attention_fwd/bwd
// (the latter are the case without attn_mask, causal, dropout or grouped heads): one implementation,
// called by the ops of attention_ops.cpp once their arguments are checked.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

#include "attention_masking.h"

namespace attn_ext::cpu {

/// Checked inputs of one attention call. q [B, Hq, L, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] with
/// unit inner stride; attn_mask undefined or a [B, Hq, L, S] view (any strides) of bool or q's
/// dtype; padding undefined or a contiguous bool [B, S].
struct AttentionCall {
  at::Tensor q, k, v, attn_mask, padding;
  double scale;
  Band band;  ///< the causal rule and sliding window (attention_masking.h)
  double dropout_p;
  int64_t seed;
  int64_t chunk;
  const char* op = "attn_ext.scaled_dot_product_attention";  ///< the public op, for errors
};

/// (out [B, Hq, L, Dv] in q's dtype, lse [B, Hq, L] fp32, fp64 for fp64 inputs).
std::tuple<at::Tensor, at::Tensor> attention_forward(const AttentionCall& call);

/// (grad_q, grad_k, grad_v), contiguous, from the gradients of out and lse and the saved out, lse.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(const AttentionCall& call, const at::Tensor& grad_out,
                                                                  const at::Tensor& grad_lse, const at::Tensor& out,
                                                                  const at::Tensor& lse);

/// The mask plane of (b, h) of a [B, Hq, L, S] attn_mask view.
template <typename Plane>
Plane mask_plane(const at::Tensor& mask, int64_t b, int64_t h) {
  if constexpr (kHasMask<Plane>) {
    using mask_t = std::remove_cv_t<std::remove_pointer_t<decltype(Plane::data)>>;
    return Plane{mask.const_data_ptr<mask_t>() + b * mask.stride(0) + h * mask.stride(1), mask.stride(2),
                 mask.stride(3)};
  } else {
    return Plane{};
  }
}

/// Dropout of (b, h) for a call with Hq query heads, L queries, S keys.
inline DropoutRule dropout_rule(const AttentionCall& call, int64_t b, int64_t h, int64_t Hq, int64_t L, int64_t S) {
  if (!(call.dropout_p > 0)) return DropoutRule{false, 0, 0, 1.0, 0, S};
  return DropoutRule{true, static_cast<uint64_t>(call.seed), dropout_threshold(call.dropout_p), 1.0 / (1.0 - call.dropout_p),
                     dropout_counter(b, h, 0, 0, Hq, L, S), S};
}

/// Runs f.template operator()<Plane>() for the attn_mask kind of `call` (scalar_t: q's element type).
template <typename scalar_t, typename F>
void dispatch_mask_kind(const AttentionCall& call, F&& f) {
  if (!call.attn_mask.defined()) {
    f.template operator()<NoMask>();
  } else if (call.attn_mask.scalar_type() == at::kBool) {
    f.template operator()<MaskPlane<bool>>();
  } else {
    f.template operator()<MaskPlane<scalar_t>>();
  }
}

}  // namespace attn_ext::cpu
