// Torch bindings of the CUDA Intention and batched Cholesky kernels (SPEC §4): intention_fwd/_bwd,
// batched_cholesky and batched_cholesky_solve for CUDA tensors (schemas in csrc/ops.cpp), with the
// CPU ops' argument checks and outputs (csrc/cpu/intention.cpp, batched_cholesky.cpp). Compiled
// only against a CUDA build of torch (setup.py).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "cross_attention_checks.h"
#include "cuda/batched_cholesky.cuh"
#include "cuda/intention.cuh"
#include "tensor_checks.h"

namespace attn_ext {
namespace cuda {
namespace {

using bindings::check_launch;
using bindings::check_on_device;
using bindings::kernel_scalar_type;
using bindings::mask_bytes;
using bindings::with_unit_inner_stride;

/// q, k, v (k standing in for the identity when v is absent) checked as the CPU op checks them.
CrossAttentionShape check_intention_inputs(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& v,
                                           const std::optional<at::Tensor>& mask, double scale, const char* op) {
  CrossAttentionShape s = check_cross_attention_inputs(q, k, v.has_value() ? *v : k, mask, scale, 1);
  if (!v.has_value()) s.value_dim = s.head_dim;
  TORCH_CHECK(q.is_cuda(), "attn_ext.", op, ": the CUDA kernel got q on ", q.device());
  kernel_scalar_type(q.scalar_type(), op);
  TORCH_CHECK_VALUE(s.head_dim <= kCholeskyMaxDim, "attn_ext.", op, " (CUDA): head dim D must be <= ",
                    kCholeskyMaxDim, " (the D×D factor is held in one block's shared memory), got q ", q.sizes());
  return s;
}

void fill_inputs(IntentionInputs& p, const CrossAttentionShape& s, const at::Tensor& q, const at::Tensor& k,
                 const at::Tensor& v, const at::Tensor& mask, double scale) {
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.defined() ? v.data_ptr() : nullptr;
  p.key_padding_mask = mask.defined() ? mask.const_data_ptr<uint8_t>() : nullptr;
  p.mask_stride_b = mask.defined() ? mask.stride(0) : 0;
  p.B = s.batch, p.H = s.heads, p.M = s.queries, p.N = s.keys, p.D = s.head_dim, p.Dv = s.value_dim;
  p.q_stride_b = q.stride(0), p.q_stride_h = q.stride(1), p.q_stride_m = q.stride(2);
  p.k_stride_b = k.stride(0), p.k_stride_h = k.stride(1), p.k_stride_n = k.stride(2);
  if (v.defined()) p.v_stride_b = v.stride(0), p.v_stride_h = v.stride(1), p.v_stride_n = v.stride(2);
  p.scale = static_cast<float>(scale);
  p.dtype = kernel_scalar_type(q.scalar_type(), "intention");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> intention_fwd_cuda(const at::Tensor& q, const at::Tensor& k,
                                                                  const std::optional<at::Tensor>& v,
                                                                  const std::optional<at::Tensor>& key_padding_mask,
                                                                  const at::Tensor& alpha, double scale) {
  const char* op = "intention_fwd";
  const CrossAttentionShape s = check_intention_inputs(q, k, v, key_padding_mask, scale, op);
  TORCH_CHECK(alpha.sizes() == at::IntArrayRef({s.batch, s.heads}), "attn_ext: alpha must be [B, H] = ",
              at::IntArrayRef({s.batch, s.heads}), ", got ", alpha.sizes());
  check_on_device(alpha, "alpha", q.device(), op);
  const at::Tensor qc = with_unit_inner_stride(q), kc = with_unit_inner_stride(k);
  const at::Tensor vc = v.has_value() ? with_unit_inner_stride(*v) : at::Tensor();
  const at::Tensor mask = key_padding_mask.has_value() ? mask_bytes(*key_padding_mask) : at::Tensor();
  const at::Tensor alpha_c = alpha.to(at::kFloat).contiguous();
  const auto f32 = q.options().dtype(at::kFloat);
  const int64_t E = s.head_dim + (v.has_value() ? s.value_dim : 0);
  at::Tensor out = at::empty({s.batch, s.heads, s.queries, s.value_dim}, q.options());
  at::Tensor factor = at::empty({s.batch, s.heads, s.head_dim, s.head_dim}, f32);
  at::Tensor weights = at::empty({s.batch, s.heads, s.head_dim, s.value_dim}, f32);
  at::Tensor stats = at::empty({s.batch, s.heads, s.head_dim, E}, f32);
  at::Tensor info = at::zeros({s.batch, s.heads}, q.options().dtype(at::kInt));
  if (s.batch * s.heads == 0) return {out, factor, weights};
  IntentionFwdParams p;
  fill_inputs(p.in, s, qc, kc, vc, mask, scale);
  p.alpha = alpha_c.const_data_ptr<float>(), p.out = out.data_ptr(), p.factor = factor.data_ptr<float>();
  p.weights = weights.data_ptr<float>(), p.stats = stats.data_ptr<float>(), p.info = info.data_ptr<int32_t>();
  const c10::cuda::CUDAGuard guard(q.device());
  check_launch(launch_intention_fwd(p, at::cuda::getCurrentCUDAStream()), op);
  // Synchronises, as the CPU op's check does: a failed factor must raise, not return NaN.
  const at::Tensor failed = info.flatten().nonzero();
  if (failed.numel() > 0) {
    const int64_t bad = failed[0][0].item<int64_t>();
    const int64_t column = info.flatten()[bad].item<int32_t>() - 1;
    TORCH_CHECK_VALUE(false, "attn_ext: KᵀK + αI is not positive definite at [batch, head] = [", bad / s.heads, ", ",
                      bad % s.heads, "] (Cholesky failed at column ", column, " of ", s.head_dim,
                      "); with alpha = 0 this happens when there are fewer valid keys than D or the keys are "
                      "collinear: use alpha > 0");
  }
  return {out, factor, weights};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> intention_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& key_padding_mask, const at::Tensor& factor, const at::Tensor& weights,
    double scale) {
  const char* op = "intention_bwd";
  const CrossAttentionShape s = check_intention_inputs(q, k, v, key_padding_mask, scale, op);
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef({s.batch, s.heads, s.queries, s.value_dim}),
              "attn_ext: grad_out must be [B, H, M, Dv], got ", grad_out.sizes(), " for q ", q.sizes());
  TORCH_CHECK(factor.sizes() == at::IntArrayRef({s.batch, s.heads, s.head_dim, s.head_dim}) &&
                  weights.sizes() == at::IntArrayRef({s.batch, s.heads, s.head_dim, s.value_dim}),
              "attn_ext: factor must be [B, H, D, D] and weights [B, H, D, Dv]; got ", factor.sizes(), " and ",
              weights.sizes());
  check_on_device(grad_out, "grad_out", q.device(), op);
  check_on_device(factor, "factor", q.device(), op);
  check_on_device(weights, "weights", q.device(), op);
  const at::Tensor qc = with_unit_inner_stride(q), kc = with_unit_inner_stride(k);
  const at::Tensor vc = v.has_value() ? with_unit_inner_stride(*v) : at::Tensor();
  const at::Tensor mask = key_padding_mask.has_value() ? mask_bytes(*key_padding_mask) : at::Tensor();
  const at::Tensor go = grad_out.to(q.scalar_type()).contiguous();
  const at::Tensor fc = factor.to(at::kFloat).contiguous(), wc = weights.to(at::kFloat).contiguous();
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor dq = at::empty({s.batch, s.heads, s.queries, s.head_dim}, q.options());
  at::Tensor dk = at::empty({s.batch, s.heads, s.keys, s.head_dim}, q.options());  // every row written
  // Without values the op still returns a grad_v slot: an empty tensor (autograd maps it to None).
  at::Tensor dv = v.has_value() ? at::empty({s.batch, s.heads, s.keys, s.value_dim}, q.options()) : q.new_empty({0});
  at::Tensor dalpha = at::empty({s.batch, s.heads}, f32);
  at::Tensor db = at::empty({s.batch, s.heads, s.head_dim, s.value_dim}, f32);
  at::Tensor e = at::empty({s.batch, s.heads, s.head_dim, s.head_dim}, f32);
  if (s.batch * s.heads == 0) return {dq, dk, dv, dalpha};
  IntentionBwdParams p;
  fill_inputs(p.in, s, qc, kc, vc, mask, scale);
  p.grad_out = go.data_ptr(), p.factor = fc.const_data_ptr<float>(), p.weights = wc.const_data_ptr<float>();
  p.grad_q = dq.data_ptr(), p.grad_k = dk.data_ptr(), p.grad_v = v.has_value() ? dv.data_ptr() : nullptr;
  p.grad_alpha = dalpha.data_ptr<float>(), p.db = db.data_ptr<float>(), p.e = e.data_ptr<float>();
  const c10::cuda::CUDAGuard guard(q.device());
  check_launch(launch_intention_bwd(p, at::cuda::getCurrentCUDAStream()), op);
  return {dq, dk, dv, dalpha};
}

ScalarType cholesky_scalar(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_cuda(), "attn_ext.", op, ": the CUDA kernel got ", name, " on ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, "attn_ext.", op,
              ": supports float32 and float64 only, got ", name, " of dtype ", t.scalar_type(),
              " (convert with .float(); a half-precision factor would be too inexact)");
  return t.scalar_type() == at::kDouble ? ScalarType::kFloat64 : ScalarType::kFloat32;
}

/// t [batch..., rows, cols] as the kernels' strided batch of matrices (a copy only when the batch
/// dimensions cannot be merged into one).
StridedMatrices as_matrices(const at::Tensor& t, int64_t batch, at::Tensor& keep) {
  keep = t.reshape({batch, t.size(-2), t.size(-1)});
  StridedMatrices m;
  m.data = keep.data_ptr();
  m.stride_batch = keep.stride(0), m.stride_row = keep.stride(1), m.stride_col = keep.stride(2);
  return m;
}

std::tuple<at::Tensor, at::Tensor> batched_cholesky_cuda(const at::Tensor& a) {
  const char* op = "batched_cholesky";
  TORCH_CHECK(a.dim() >= 2 && a.size(-1) == a.size(-2),
              "attn_ext.batched_cholesky: A must be a batch of square matrices [..., n, n], got shape ", a.sizes());
  const ScalarType dtype = cholesky_scalar(a, op, "A");
  const int64_t n = a.size(-1);
  TORCH_CHECK_VALUE(n <= kCholeskyMaxDim, "attn_ext.batched_cholesky (CUDA): n must be <= ", kCholeskyMaxDim,
                    " (one matrix per block, in shared memory), got A of shape ", a.sizes());
  const std::vector<int64_t> batch_sizes(a.sizes().begin(), a.sizes().end() - 2);
  at::Tensor l = at::empty(a.sizes(), a.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor info = at::zeros(batch_sizes, a.options().dtype(at::kInt));
  const int64_t batch = info.numel();
  if (batch == 0 || n == 0) return {l, info};
  BatchedCholeskyParams p;
  at::Tensor a3;
  p.a = as_matrices(a, batch, a3);
  p.l = l.data_ptr(), p.info = info.data_ptr<int32_t>(), p.batch = batch, p.n = n, p.dtype = dtype;
  const c10::cuda::CUDAGuard guard(a.device());
  check_launch(launch_batched_cholesky(p, at::cuda::getCurrentCUDAStream()), op);
  return {l, info};
}

at::Tensor batched_cholesky_solve_cuda(const at::Tensor& l, const at::Tensor& b) {
  const char* op = "batched_cholesky_solve";
  TORCH_CHECK(l.dim() >= 2 && l.size(-1) == l.size(-2),
              "attn_ext.batched_cholesky_solve: L must be a batch of square matrices [..., n, n], got shape ",
              l.sizes());
  TORCH_CHECK(b.dim() == l.dim() && b.size(-2) == l.size(-1) &&
                  std::equal(l.sizes().begin(), l.sizes().end() - 2, b.sizes().begin()),
              "attn_ext.batched_cholesky_solve: B must be [..., n, r] with the batch dimensions and n of L ",
              l.sizes(), " (no broadcasting), got B of shape ", b.sizes());
  const ScalarType dtype = cholesky_scalar(l, op, "L");
  cholesky_scalar(b, op, "B");
  TORCH_CHECK(l.scalar_type() == b.scalar_type(), "attn_ext.batched_cholesky_solve: L and B must share a dtype, got ",
              l.scalar_type(), " and ", b.scalar_type());
  check_on_device(b, "B", l.device(), op);
  const int64_t n = l.size(-1), r = b.size(-1);
  TORCH_CHECK_VALUE(n <= kCholeskyMaxDim, "attn_ext.batched_cholesky_solve (CUDA): n must be <= ", kCholeskyMaxDim,
                    ", got L of shape ", l.sizes());
  at::Tensor x = at::empty(b.sizes(), b.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t batch = x.numel() == 0 ? 0 : x.numel() / (n * r);
  if (batch == 0) return x;
  const CholeskyLaunchPlan plan = plan_batched_cholesky(batch, n, r, dtype);
  TORCH_CHECK_VALUE(plan.supported, "attn_ext.batched_cholesky_solve (CUDA): ", plan.error, "; got L ", l.sizes(),
                    ", B ", b.sizes());
  BatchedCholeskySolveParams p;
  at::Tensor l3, b3;
  p.l = as_matrices(l, batch, l3);
  p.b = as_matrices(b, batch, b3);
  p.x = x.data_ptr(), p.batch = batch, p.n = n, p.r = r, p.dtype = dtype;
  const c10::cuda::CUDAGuard guard(l.device());
  check_launch(launch_batched_cholesky_solve(p, at::cuda::getCurrentCUDAStream()), op);
  return x;
}

}  // namespace
}  // namespace cuda
}  // namespace attn_ext

TORCH_LIBRARY_IMPL(attn_ext, CUDA, m) {
  m.impl("intention_fwd", &attn_ext::cuda::intention_fwd_cuda);
  m.impl("intention_bwd", &attn_ext::cuda::intention_bwd_cuda);
  m.impl("batched_cholesky", &attn_ext::cuda::batched_cholesky_cuda);
  m.impl("batched_cholesky_solve", &attn_ext::cuda::batched_cholesky_solve_cuda);
}
