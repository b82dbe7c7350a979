// Argument checks of the Intention ops and the batched Cholesky ops under them, shared by the CPU ops
// and the CUDA bindings so that both fail with the same messages. What only one device needs (its
// own device test, the CUDA kernels' size limits) stays with that device's wrapper.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "checks/cross_attention_checks.h"

namespace attn_ext {

/// q/k (and v when given; without v, C = I and k stands in for it, so Dv = D) by the
/// cross-attention rules.
inline CrossAttentionShape check_intention_inputs(const at::Tensor& q, const at::Tensor& k,
                                                  const std::optional<at::Tensor>& v,
                                                  const std::optional<at::Tensor>& key_padding_mask, double scale) {
  CrossAttentionShape s = check_cross_attention_inputs(q, k, v.has_value() ? *v : k, key_padding_mask, scale, 1);
  if (!v.has_value()) s.value_dim = s.head_dim;
  return s;
}

/// The ridge α of every (batch, head).
inline void check_intention_alpha(const at::Tensor& alpha, const CrossAttentionShape& s) {
  TORCH_CHECK(alpha.sizes() == at::IntArrayRef({s.batch, s.heads}), "attn_ext: alpha must be [B, H] = ",
              at::IntArrayRef({s.batch, s.heads}), ", got ", alpha.sizes());
}

/// The backward's grad_out and the forward's saved factor and weights against the inputs' sizes.
inline void check_intention_bwd_inputs(const CrossAttentionShape& s, const at::Tensor& q, const at::Tensor& grad_out,
                                       const at::Tensor& factor, const at::Tensor& weights) {
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef({s.batch, s.heads, s.queries, s.value_dim}),
              "attn_ext: grad_out must be [B, H, M, Dv], got ", grad_out.sizes(), " for q ", q.sizes());
  TORCH_CHECK(factor.sizes() == at::IntArrayRef({s.batch, s.heads, s.head_dim, s.head_dim}) &&
                  weights.sizes() == at::IntArrayRef({s.batch, s.heads, s.head_dim, s.value_dim}),
              "attn_ext: factor must be [B, H, D, D] and weights [B, H, D, Dv]; got ", factor.sizes(), " and ",
              weights.sizes());
}

/// Raises the error of a failed factorisation at (batch·head) index `bad`, whose Cholesky info is
/// `info` (column + 1); nothing when bad < 0. A failed factor must raise, not return NaN.
inline void check_positive_definite(int64_t bad, int64_t info, const CrossAttentionShape& s) {
  TORCH_CHECK_VALUE(bad < 0, "attn_ext: KᵀK + αI is not positive definite at [batch, head] = [", bad / s.heads, ", ",
                    bad % s.heads, "] (Cholesky failed at column ", info - 1, " of ", s.head_dim,
                    "); with alpha = 0 this happens when there are fewer valid keys than D or the keys are "
                    "collinear: use alpha > 0");
}

/// The Cholesky ops take float32 and float64 only. Half inputs are refused rather than upcast: the
/// Intention op accumulates KᵀK in fp32 anyway, and a half-precision factor would be too inexact.
inline void check_cholesky_dtype(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, "attn_ext.", op,
              ": supports float32 and float64 only, got ", name, " of dtype ", t.scalar_type(),
              " (convert with .float(); a half-precision factor would be too inexact)");
}

/// `a` (called `name` in messages) is a batch of square float32/float64 matrices [..., n, n].
inline void check_square_matrices(const char* op, const char* name, const at::Tensor& a) {
  TORCH_CHECK(a.dim() >= 2 && a.size(-1) == a.size(-2), "attn_ext.", op, ": ", name,
              " must be a batch of square matrices [..., n, n], got shape ", a.sizes());
}

/// The inputs of a solve: `a` (`a_name`: the factor L or the matrix A) [..., n, n] and B [..., n, r]
/// with the same batch dimensions (no broadcasting) and dtype, float32 or float64.
inline void check_cholesky_solve_inputs(const char* op, const char* a_name, const at::Tensor& a, const at::Tensor& b) {
  check_square_matrices(op, a_name, a);
  TORCH_CHECK(b.dim() == a.dim() && b.size(-2) == a.size(-1) &&
                  std::equal(a.sizes().begin(), a.sizes().end() - 2, b.sizes().begin()),
              "attn_ext.", op, ": B must be [..., n, r] with the batch dimensions and n of ", a_name, " ", a.sizes(),
              " (no broadcasting), got B of shape ", b.sizes());
  check_cholesky_dtype(op, a_name, a);
  check_cholesky_dtype(op, "B", b);
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "attn_ext.", op, ": ", a_name, " and B must share a dtype, got ",
              a.scalar_type(), " and ", b.scalar_type());
}

}  // namespace attn_ext
