// Argument checks of the translation-equivariant attention ops (csrc/op_list.h, te_attention_fwd/bwd): every
// message names the op and the shapes it got, as the Python front end's (attn_ext/ops/te_attention/attention.py).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <optional>

#include "attn_ext/te_activation.h"
#include "checks/common.h"

namespace attn_ext {

/// The sizes of a te_attention call: q [B, H, M, D], k [B, H, N, D], v [B, H, N, Dv], xq [B, M, dx], xk [B, N, dx],
/// w1 [hidden, H + dx], b1 [hidden], w2 [H, hidden], b2 [H].
struct TeAttentionShape {
  int64_t B, H, M, N, D, Dv, dx, hidden;
};

inline TeAttentionShape check_te_attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& xq, const at::Tensor& xk, const at::Tensor& w1,
                                                  const at::Tensor& b1, const at::Tensor& w2, const at::Tensor& b2,
                                                  const std::optional<at::Tensor>& key_padding_mask, double scale,
                                                  int64_t activation, int64_t chunk_size) {
  constexpr const char* who = "attn_ext.te_attention";
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && xq.dim() == 3 && xk.dim() == 3, who,
                    ": expected q [B, H, M, D], k [B, H, N, D], v [B, H, N, Dv], xq [B, M, dx], xk [B, N, dx]; got q ",
                    q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), ", xq ", xq.sizes(), ", xk ", xk.sizes());
  const TeAttentionShape s{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), v.size(3), xq.size(2), w1.size(0)};
  const bool qkv = k.size(0) == s.B && v.size(0) == s.B && k.size(1) == s.H && v.size(1) == s.H &&
                   v.size(2) == s.N && k.size(3) == s.D;
  const bool inputs = xq.size(0) == s.B && xk.size(0) == s.B && xq.size(1) == s.M && xk.size(1) == s.N &&
                      xk.size(2) == s.dx;
  TORCH_CHECK_VALUE(qkv && inputs, who, ": expected q [B, H, M, D], k [B, H, N, D], v [B, H, N, Dv], xq [B, M, dx], "
                    "xk [B, N, dx] with one B, H, M, N, D and dx; got q ", q.sizes(), ", k ", k.sizes(), ", v ",
                    v.sizes(), ", xq ", xq.sizes(), ", xk ", xk.sizes());
  const bool mlp = w1.dim() == 2 && w1.size(1) == s.H + s.dx && b1.dim() == 1 && b1.size(0) == s.hidden &&
                   w2.dim() == 2 && w2.size(0) == s.H && w2.size(1) == s.hidden && b2.dim() == 1 && b2.size(0) == s.H;
  TORCH_CHECK_VALUE(mlp, who, ": the MLP's weights must be w1 [hidden, H + dx] = [hidden, ", s.H + s.dx,
                    "], b1 [hidden], w2 [H, hidden] = [", s.H, ", hidden], b2 [H] = [", s.H, "]; got w1 ", w1.sizes(),
                    ", b1 ", b1.sizes(), ", w2 ", w2.sizes(), ", b2 ", b2.sizes());
  const at::ScalarType dtype = q.scalar_type();
  for (const at::Tensor* t : {&k, &v, &xq, &xk, &w1, &b1, &w2, &b2}) {
    TORCH_CHECK_TYPE(t->scalar_type() == dtype, who, ": q, k, v, xq, xk, w1, b1, w2, b2 must share one dtype; q is ",
                     dtype, ", another is ", t->scalar_type());
  }
  TORCH_CHECK_TYPE(scalar_type_of(dtype).has_value(), who, ": takes float16, bfloat16, float32 or float64, not ",
                   dtype);
  if (key_padding_mask.has_value()) {
    const at::Tensor& mask = *key_padding_mask;
    TORCH_CHECK_VALUE(mask.dim() == 2 && mask.size(0) == s.B && mask.size(1) == s.N, who,
                      ": key_padding_mask must be [B, N] = [", s.B, ", ", s.N, "], got ", mask.sizes());
    TORCH_CHECK_TYPE(mask.scalar_type() == at::kBool, who, ": key_padding_mask must be bool, got ",
                     mask.scalar_type());
  }
  TORCH_CHECK_VALUE(std::isfinite(scale), who, ": scale must be a finite float, got ", scale);
  TORCH_CHECK_VALUE(activation >= 0 && activation < kTeActivationCount, who,
                    ": activation must be 0 (relu), 1 (gelu), 2 (silu) or 3 (tanh), got ", activation);
  TORCH_CHECK_VALUE(chunk_size >= 0, who, ": chunk_size must be >= 0 (0: the kernel's choice), got ", chunk_size);
  return s;
}

/// The backward's extra tensors: grad_out and out [B, H, M, Dv] in q's dtype, grad_lse and lse [B, H, M] in the
/// accumulation dtype.
inline void check_te_attention_grads(const TeAttentionShape& s, const at::Tensor& q, const at::Tensor& grad_out,
                                     const at::Tensor& grad_lse, const at::Tensor& out, const at::Tensor& lse) {
  constexpr const char* who = "attn_ext.te_attention (backward)";
  const std::vector<int64_t> rows{s.B, s.H, s.M, s.Dv}, stats{s.B, s.H, s.M};
  TORCH_CHECK_VALUE(grad_out.sizes() == rows && out.sizes() == rows, who, ": grad_out and out must be [B, H, M, Dv] = ",
                    at::IntArrayRef(rows), ", got ", grad_out.sizes(), " and ", out.sizes());
  TORCH_CHECK_VALUE(grad_lse.sizes() == stats && lse.sizes() == stats, who, ": grad_lse and lse must be [B, H, M] = ",
                    at::IntArrayRef(stats), ", got ", grad_lse.sizes(), " and ", lse.sizes());
  const at::ScalarType acc = accumulation_dtype(q.scalar_type());
  TORCH_CHECK_TYPE(grad_out.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(), who,
                   ": grad_out and out must be ", q.scalar_type(), " as q, got ", grad_out.scalar_type(), " and ",
                   out.scalar_type());
  TORCH_CHECK_TYPE(grad_lse.scalar_type() == acc && lse.scalar_type() == acc, who, ": grad_lse and lse must be ", acc,
                   ", got ", grad_lse.scalar_type(), " and ", lse.scalar_type());
}

}  // namespace attn_ext
