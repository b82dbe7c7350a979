// Argument checks of the Intention ops and the batched Cholesky ops under them, shared by the CPU ops
// and the CUDA bindings so that both fail with the same messages. What only one device needs (its
// own device test, the CUDA kernels' size limits) stays with that device's wrapper.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include <c10/util/StringUtil.h>

#include "checks/attention_checks.h"

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

/// Per-head status of the Intention solve besides 0 (solved) and a Cholesky info j + 1 > 0 (the pivot of
/// column j was not positive: KᵀK + αI is finite but not positive definite).
constexpr int kIntentionNonFinite = -1;   ///< [KᵀK | KᵀV] holds NaN/inf: NaN outputs for that head, not an error
constexpr int kIntentionTooFewKeys = -2;  ///< α = 0 with fewer valid keys than D: KᵀK is singular, whatever the keys

/// Raises the error of a singular system at (batch·head) index `bad` (nothing when bad < 0), whose status
/// is `info` (a Cholesky info or kIntentionTooFewKeys). `op` names the public op. A singular system must raise:
/// with α = 0, rounding can let a singular KᵀK factorise, and the answer would then be noise, not a
/// minimum-norm solution. Called once per op after the parallel loop; it reads alpha and the mask then.
inline void check_solvable(const char* op, int64_t bad, int info, const CrossAttentionShape& s, const at::Tensor& alpha,
                           const std::optional<at::Tensor>& key_padding_mask) {
  if (bad < 0) return;
  const int64_t b = bad / s.heads, h = bad % s.heads;
  const double a = alpha.reshape({-1})[bad].item<double>();
  const int64_t valid = key_padding_mask.has_value()
                            ? s.keys - key_padding_mask->select(0, b).sum().item<int64_t>()
                            : s.keys;
  const std::string why =
      info == kIntentionTooFewKeys
          ? c10::str("alpha = 0 with ", valid, " valid keys for head dim D = ", s.head_dim, " (KᵀK has rank at most ",
                     valid, ")")
          : c10::str("the Cholesky pivot of column ", info - 1, " of ", s.head_dim, " is not positive (alpha = ", a,
                     ", ", valid, " valid keys)");
  TORCH_CHECK(false, "attn_ext.", op, ": KᵀK + αI is singular at [batch, head] = [", b, ", ", h, "]: ", why,
              ". alpha = 0 needs KᵀK invertible, i.e. at least D valid keys (N >= D) of full rank D (no collinear "
              "keys); use alpha > 0 (ridge) for fewer or collinear keys");
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
