// CPU forward and backward of Intention (docs/spec.md §4), primal form: out = scale·Q (KᵀK + αI)⁻¹ KᵀV.
//
// One work item is one (batch, head) (at::parallel_for); inside it everything is BLAS on small
// thread-local buffers in the accumulation dtype:
//  * the statistics G = KᵀK (its lower block triangle: the Cholesky reads no more) and C = KᵀV are
//    accumulated over chunks of valid keys, copied (and upcast) into a buffer: padding keys are
//    skipped, never multiplied by 0, and no masked or fp32 copy of K/V is materialised;
//  * A = G + αI is factorised (cholesky_simd.h, the batched Cholesky ops' per-matrix code);
//  * W = A⁻¹C by two triangular solves, out = scale·Q W.
// The factor L and W are returned for the backward, which then needs one more solve and no inverse:
//     dQ = scale·dY Wᵀ,  dB = A⁻¹(scale·Qᵀ dY),  dK = −K(dB Wᵀ + W dBᵀ) + V dBᵀ,  dV = K dB,
//     dα = −Σ dB ⊙ W.
// Without values (v = None) C is the identity: out = scale·Q (KᵀK + αI)⁻¹ are σIntention's
// transformed queries, and the same formulas hold without the V terms.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <type_traits>
#include <tuple>
#include <vector>

#include "blas.h"
#include "cholesky_simd.h"
#include "intention_head.h"
#include "ops.h"

namespace attn_ext::cpu {
namespace {

using namespace intention;

/// Forward of one (b, h): writes out rows, the factor L [D, D] and W [D, Dv]; returns 0 or the error
/// status of solve_weights. Non-finite statistics give an all-NaN head (and NaN L, W for the backward).
template <typename scalar_t, typename acc_t>
int forward_head(const IntentionArgs<scalar_t>& a, int64_t b, int64_t h, acc_t alpha, acc_t scale, scalar_t* out,
                 acc_t* factor, acc_t* weights, ForwardScratch<acc_t>& w) {
  const int64_t D = a.D, Dv = a.Dv;
  scalar_t* out_bh = out + (b * a.H + h) * a.M * Dv;
  const int info = solve_weights(a, b, h, alpha, factor, weights, w);
  if (info == kIntentionNonFinite) {
    std::fill(out_bh, out_bh + a.M * Dv, static_cast<scalar_t>(std::numeric_limits<acc_t>::quiet_NaN()));
    return 0;
  }
  if (info != 0) return info;
  const scalar_t* q_bh = a.q + b * a.qs0 + h * a.qs1;
  if constexpr (std::is_same_v<scalar_t, acc_t>) {  // straight from q into out
    if (a.M > 0 && a.qs2 >= D) {
      gemm(Transpose::kNo, Transpose::kNo, a.M, Dv, D, scale, q_bh, a.qs2, weights, Dv, acc_t(0), out_bh, Dv);
      nan_rows_of_nonfinite_queries(q_bh, a.qs2, a.M, D, scale, out_bh, Dv, Dv);
      return 0;
    }
  }
  for (int64_t m0 = 0; m0 < a.M; m0 += kRowChunk) {
    const int64_t rows_m = std::min(kRowChunk, a.M - m0);
    upcast_rows(q_bh + m0 * a.qs2, a.qs2, rows_m, D, w.qbuf.get());
    gemm(Transpose::kNo, Transpose::kNo, rows_m, Dv, D, scale, w.qbuf.get(), D, weights, Dv, acc_t(0), w.obuf.get(), Dv);
    nan_rows_of_nonfinite_queries(w.qbuf.get(), D, rows_m, D, scale, w.obuf.get(), Dv, Dv);
    scalar_t* dst = out_bh + m0 * Dv;
    for (int64_t i = 0; i < rows_m * Dv; ++i) dst[i] = static_cast<scalar_t>(w.obuf[i]);
  }
  return 0;
}

/// Backward of one (b, h); see the file comment.
template <typename scalar_t, typename acc_t>
void backward_head(const IntentionArgs<scalar_t>& a, const scalar_t* grad_out, const acc_t* factor,
                   const acc_t* weights, int64_t b, int64_t h, acc_t scale, scalar_t* dq, scalar_t* dk, scalar_t* dv,
                   acc_t* dalpha) {
  const int64_t D = a.D, Dv = a.Dv, bh = b * a.H + h;
  std::vector<acc_t> qbuf(kRowChunk * D), gbuf(kRowChunk * Dv), dqbuf(kRowChunk * D), db(D * Dv, acc_t(0));
  for (int64_t m0 = 0; m0 < a.M; m0 += kRowChunk) {
    const int64_t rows_m = std::min(kRowChunk, a.M - m0);
    upcast_rows(a.q + b * a.qs0 + h * a.qs1 + m0 * a.qs2, a.qs2, rows_m, D, qbuf.data());
    upcast_rows(grad_out + (bh * a.M + m0) * Dv, Dv, rows_m, Dv, gbuf.data());
    gemm(Transpose::kNo, Transpose::kYes, rows_m, D, Dv, scale, gbuf.data(), Dv, weights, Dv, acc_t(0), dqbuf.data(),
         D);
    scalar_t* dst = dq + (bh * a.M + m0) * D;
    for (int64_t i = 0; i < rows_m * D; ++i) dst[i] = static_cast<scalar_t>(dqbuf[i]);
    gemm(Transpose::kYes, Transpose::kNo, D, Dv, rows_m, scale, qbuf.data(), D, gbuf.data(), Dv, acc_t(1), db.data(),
         Dv);
  }
  std::vector<acc_t> rhs(db);
  cholesky_solve_batch(factor, BatchStrides{0, D, 1}, rhs.data(), BatchStrides{0, Dv, 1}, db.data(), D, Dv, 0, 1);
  acc_t da = acc_t(0);
  for (int64_t i = 0; i < D * Dv; ++i) da -= db[i] * weights[i];
  *dalpha = da;
  // E = dB Wᵀ + W dBᵀ (symmetric), the gradient of G up to the sign.
  std::vector<acc_t> e(D * D);
  gemm(Transpose::kNo, Transpose::kYes, D, D, Dv, acc_t(1), db.data(), Dv, weights, Dv, acc_t(0), e.data(), D);
  for (int64_t i = 0; i < D; ++i) {
    for (int64_t j = 0; j < i; ++j) e[i * D + j] = e[j * D + i] = e[i * D + j] + e[j * D + i];
    e[i * D + i] *= acc_t(2);
  }
  std::vector<acc_t> kbuf(kRowChunk * D), vbuf(kRowChunk * Dv), dkbuf(kRowChunk * D), dvbuf(kRowChunk * Dv);
  std::vector<int64_t> rows(kRowChunk);
  // Padding keys keep zero gradients: the outputs were zero-filled and only valid rows are written.
  int64_t next = 0;
  while (true) {
    const int64_t count = gather_valid_rows(a, b, h, &next, kbuf.data(), vbuf.data(), rows.data());
    if (count == 0) break;
    gemm(Transpose::kNo, Transpose::kNo, count, D, D, acc_t(-1), kbuf.data(), D, e.data(), D, acc_t(0), dkbuf.data(),
         D);
    if (a.has_v) {
      gemm(Transpose::kNo, Transpose::kYes, count, D, Dv, acc_t(1), vbuf.data(), Dv, db.data(), Dv, acc_t(1),
           dkbuf.data(), D);
      gemm(Transpose::kNo, Transpose::kNo, count, Dv, D, acc_t(1), kbuf.data(), D, db.data(), Dv, acc_t(0),
           dvbuf.data(), Dv);
    }
    for (int64_t r = 0; r < count; ++r) {
      scalar_t* dk_row = dk + (bh * a.N + rows[r]) * D;
      for (int64_t d = 0; d < D; ++d) dk_row[d] = static_cast<scalar_t>(dkbuf[r * D + d]);
      if (!a.has_v) continue;
      scalar_t* dv_row = dv + (bh * a.N + rows[r]) * Dv;
      for (int64_t d = 0; d < Dv; ++d) dv_row[d] = static_cast<scalar_t>(dvbuf[r * Dv + d]);
    }
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> intention_fwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                                                 const std::optional<at::Tensor>& v,
                                                                 const std::optional<at::Tensor>& key_padding_mask,
                                                                 const at::Tensor& alpha, double scale) {
  const CrossAttentionShape s = check_intention_inputs(q, k, v, key_padding_mask, scale);
  check_intention_alpha(alpha, s);
  const at::ScalarType acc_dtype = accumulation_dtype(q.scalar_type());
  const at::Tensor qc = with_unit_inner_stride(q), kc = with_unit_inner_stride(k);
  const at::Tensor vc = v.has_value() ? with_unit_inner_stride(*v) : at::Tensor();
  const at::Tensor mask = key_padding_mask.has_value() ? key_padding_mask->contiguous() : at::Tensor();
  const at::Tensor alpha_c = alpha.to(acc_dtype).contiguous();
  at::Tensor out = at::empty({s.batch, s.heads, s.queries, s.value_dim}, q.options());
  at::Tensor factor = at::empty({s.batch, s.heads, s.head_dim, s.head_dim}, q.options().dtype(acc_dtype));
  at::Tensor weights = at::empty({s.batch, s.heads, s.head_dim, s.value_dim}, q.options().dtype(acc_dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "attn_ext::intention_fwd", [&] {
    using acc_t = acc_type<scalar_t>;
    const IntentionArgs<scalar_t> a = make_args<scalar_t>(qc, kc, vc, mask);
    const acc_t* alpha_data = alpha_c.const_data_ptr<acc_t>();
    const auto [bad, info] = for_each_head<acc_t>(s.batch * s.heads, s.head_dim, s.value_dim,
                                                  [&](int64_t bh, ForwardScratch<acc_t>& scratch) {
      return forward_head<scalar_t, acc_t>(a, bh / s.heads, bh % s.heads, alpha_data[bh], static_cast<acc_t>(scale),
                                           out.mutable_data_ptr<scalar_t>(),
                                           factor.mutable_data_ptr<acc_t>() + bh * s.head_dim * s.head_dim,
                                           weights.mutable_data_ptr<acc_t>() + bh * s.head_dim * s.value_dim, scratch);
    });
    // Without values this op makes σIntention's transformed queries (its CUDA and unfused paths).
    check_solvable(v.has_value() ? "intention" : "sigma_intention", bad, info, s, alpha, key_padding_mask);
  });
  return {out, factor, weights};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> intention_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& key_padding_mask, const at::Tensor& factor, const at::Tensor& weights,
    double scale) {
  const CrossAttentionShape s = check_intention_inputs(q, k, v, key_padding_mask, scale);
  check_intention_bwd_inputs(s, q, grad_out, factor, weights);
  const at::ScalarType acc_dtype = accumulation_dtype(q.scalar_type());
  const at::Tensor qc = with_unit_inner_stride(q), kc = with_unit_inner_stride(k);
  const at::Tensor vc = v.has_value() ? with_unit_inner_stride(*v) : at::Tensor();
  const at::Tensor mask = key_padding_mask.has_value() ? key_padding_mask->contiguous() : at::Tensor();
  const at::Tensor go = grad_out.to(q.scalar_type()).contiguous();
  const at::Tensor fc = factor.to(acc_dtype).contiguous(), wc = weights.to(acc_dtype).contiguous();
  at::Tensor dq = at::empty({s.batch, s.heads, s.queries, s.head_dim}, q.options());
  at::Tensor dk = at::zeros({s.batch, s.heads, s.keys, s.head_dim}, q.options());
  // Without values the op still returns a grad_v slot: an empty tensor (autograd maps it to None).
  at::Tensor dv = v.has_value() ? at::zeros({s.batch, s.heads, s.keys, s.value_dim}, q.options()) : q.new_empty({0});
  at::Tensor dalpha = at::empty({s.batch, s.heads}, q.options().dtype(acc_dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "attn_ext::intention_bwd", [&] {
    using acc_t = acc_type<scalar_t>;
    const IntentionArgs<scalar_t> a = make_args<scalar_t>(qc, kc, vc, mask);
    at::parallel_for(0, s.batch * s.heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        backward_head<scalar_t, acc_t>(a, go.const_data_ptr<scalar_t>(),
                                       fc.const_data_ptr<acc_t>() + bh * s.head_dim * s.head_dim,
                                       wc.const_data_ptr<acc_t>() + bh * s.head_dim * s.value_dim, bh / s.heads,
                                       bh % s.heads, static_cast<acc_t>(scale), dq.mutable_data_ptr<scalar_t>(),
                                       dk.mutable_data_ptr<scalar_t>(), dv.mutable_data_ptr<scalar_t>(),
                                       dalpha.mutable_data_ptr<acc_t>() + bh);
      }
    });
  });
  return {dq, dk, dv, dalpha};
}

}  // namespace attn_ext::cpu
