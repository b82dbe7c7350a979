// Typed wrappers of the CUDA Intention and batched Cholesky kernels (docs/spec.md §4): intention_fwd/_bwd,
// batched_cholesky and batched_cholesky_solve for CUDA tensors (declared in ops.h, registered in
// registration.cpp). Inputs are validated by the checks the CPU ops use
// (csrc/checks/intention_checks.h, same messages); outputs have the CPU ops' shapes and dtypes.
// Compiled only against a CUDA build of torch.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "checks/intention_checks.h"
#include "cuda/batched_cholesky.cuh"
#include "cuda/intention.cuh"
#include "cuda/intention_plan.h"
#include "ops.h"
#include "tensor_checks.h"

namespace attn_ext {
namespace cuda {
namespace {

using namespace bindings;  // tensor_checks.h: dtype mapping, device checks, mask bytes, launch errors

/// q, k, v checked as the CPU op checks them, then what only the CUDA kernels need.
CrossAttentionShape check_cuda_inputs(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& v,
                                      const std::optional<at::Tensor>& mask, double scale, const char* op) {
  const CrossAttentionShape s = check_intention_inputs(q, k, v, mask, scale);
  check_is_cuda(q, "q", op);
  kernel_scalar_type(q.scalar_type(), op);
  TORCH_CHECK_VALUE(s.head_dim <= kCholeskyMaxDim, "attn_ext.", op, " (CUDA): head dim D must be <= ",
                    kCholeskyMaxDim, " (the D×D factor is held in one block's shared memory), got q ", q.sizes());
  return s;
}

void fill_inputs(IntentionInputs& p, const CrossAttentionShape& s, const at::Tensor& q, const at::Tensor& k,
                 const at::Tensor& v, const at::Tensor& mask, double scale) {
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.defined() ? v.data_ptr() : nullptr, p.has_values = v.defined();
  p.key_padding_mask = mask.defined() ? mask.const_data_ptr<uint8_t>() : nullptr;
  p.B = s.batch, p.H = s.heads, p.M = s.queries, p.N = s.keys, p.D = s.head_dim, p.Dv = s.value_dim;
  fill_qkv_layout(p, q, k, v, mask, scale, kernel_scalar_type(q.scalar_type(), "intention"));
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

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> intention_fwd_cuda(const at::Tensor& q, const at::Tensor& k,
                                                                  const std::optional<at::Tensor>& v,
                                                                  const std::optional<at::Tensor>& key_padding_mask,
                                                                  const at::Tensor& alpha, double scale) {
  const char* op = "intention_fwd";
  const CrossAttentionShape s = check_cuda_inputs(q, k, v, key_padding_mask, scale, op);
  check_intention_alpha(alpha, s);
  check_on_device(alpha, "alpha", q.device(), op);
  const at::Tensor qc = with_unit_inner_stride(q), kc = with_unit_inner_stride(k);
  const at::Tensor vc = v.has_value() ? with_unit_inner_stride(*v) : at::Tensor();
  const at::Tensor mask = key_padding_mask.has_value() ? mask_bytes(*key_padding_mask) : at::Tensor();
  const at::ScalarType acc_dtype = accumulation_dtype(q.scalar_type());
  const at::Tensor alpha_c = alpha.to(acc_dtype).contiguous();
  const auto acc = q.options().dtype(acc_dtype);
  const int64_t E = s.head_dim + (v.has_value() ? s.value_dim : 0);
  at::Tensor out = at::empty({s.batch, s.heads, s.queries, s.value_dim}, q.options());
  at::Tensor factor = at::empty({s.batch, s.heads, s.head_dim, s.head_dim}, acc);
  at::Tensor weights = at::empty({s.batch, s.heads, s.head_dim, s.value_dim}, acc);
  at::Tensor stats = at::empty({s.batch, s.heads, s.head_dim, E}, acc);
  at::Tensor info = at::zeros({s.batch, s.heads}, q.options().dtype(at::kInt));
  if (s.batch * s.heads == 0) return {out, factor, weights};
  IntentionFwdParams p;
  fill_inputs(p.in, s, qc, kc, vc, mask, scale);
  p.alpha = alpha_c.const_data_ptr<float>(), p.out = out.data_ptr(), p.factor = factor.data_ptr<float>();
  p.weights = weights.data_ptr<float>(), p.stats = stats.data_ptr<float>(), p.info = info.data_ptr<int32_t>();
  check_plan(plan_intention_fwd(p, smem_limit_of(q.device(), op)), op,
             [&] { return c10::str("q ", q.sizes(), ", k ", k.sizes()); });
  const c10::cuda::CUDAGuard guard(q.device());
  check_launch(launch_intention_fwd(p, at::cuda::getCurrentCUDAStream()), op);
  // The CPU op's rules (csrc/cpu/intention_head.h) in ATen ops on the device. A head whose statistics
  // [KᵀK | KᵀV] (still in `stats`: the factorisation writes `factor`) are not finite gets NaN; α = 0
  // with fewer than D valid keys, or a failed factorisation of finite statistics, raises (this
  // synchronises, as the CPU op's check does).
  const at::Tensor finite = stats.isfinite().flatten(2).all(-1);
  const at::Tensor valid = key_padding_mask.has_value()
                               ? (s.keys - key_padding_mask->sum(1)).view({s.batch, 1})
                               : at::full({s.batch, 1}, s.keys, info.options().dtype(at::kLong));
  const at::Tensor too_few = alpha_c.eq(0).logical_and(valid.lt(s.head_dim)).logical_and(finite);
  const at::Tensor status =
      at::where(too_few, at::full_like(info, kIntentionTooFewKeys), info.masked_fill(finite.logical_not(), 0));
  const at::Tensor failed = status.flatten().nonzero();
  if (failed.numel() > 0) {
    const int64_t bad = failed[0][0].item<int64_t>();
    check_solvable(v.has_value() ? "intention" : "sigma_intention", bad, status.flatten()[bad].item<int32_t>(), s,
                   alpha, key_padding_mask);
  }
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const at::Tensor nonfinite = finite.logical_not().view({s.batch, s.heads, 1, 1});
  factor.masked_fill_(nonfinite, nan);
  weights.masked_fill_(nonfinite, nan);
  out.masked_fill_(nonfinite, nan);
  out.masked_fill_(q.isfinite().all(-1, /*keepdim=*/true).logical_not(), nan);  // ±inf queries too give NaN rows
  return {out, factor, weights};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> intention_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& key_padding_mask, const at::Tensor& factor, const at::Tensor& weights,
    double scale) {
  const char* op = "intention_bwd";
  const CrossAttentionShape s = check_cuda_inputs(q, k, v, key_padding_mask, scale, op);
  check_intention_bwd_inputs(s, q, grad_out, factor, weights);
  check_on_device(grad_out, "grad_out", q.device(), op);
  check_on_device(factor, "factor", q.device(), op);
  check_on_device(weights, "weights", q.device(), op);
  const at::Tensor qc = with_unit_inner_stride(q), kc = with_unit_inner_stride(k);
  const at::Tensor vc = v.has_value() ? with_unit_inner_stride(*v) : at::Tensor();
  const at::Tensor mask = key_padding_mask.has_value() ? mask_bytes(*key_padding_mask) : at::Tensor();
  const at::Tensor go = grad_out.to(q.scalar_type()).contiguous();
  const at::ScalarType acc_dtype = accumulation_dtype(q.scalar_type());
  const at::Tensor fc = factor.to(acc_dtype).contiguous(), wc = weights.to(acc_dtype).contiguous();
  const auto acc = q.options().dtype(acc_dtype);
  at::Tensor dq = at::empty({s.batch, s.heads, s.queries, s.head_dim}, q.options());
  at::Tensor dk = at::empty({s.batch, s.heads, s.keys, s.head_dim}, q.options());  // every row written
  // Without values the op still returns a grad_v slot: an empty tensor (autograd maps it to None).
  at::Tensor dv = v.has_value() ? at::empty({s.batch, s.heads, s.keys, s.value_dim}, q.options()) : q.new_empty({0});
  at::Tensor dalpha = at::empty({s.batch, s.heads}, acc);
  at::Tensor db = at::empty({s.batch, s.heads, s.head_dim, s.value_dim}, acc);
  at::Tensor e = at::empty({s.batch, s.heads, s.head_dim, s.head_dim}, acc);
  if (s.batch * s.heads == 0) return {dq, dk, dv, dalpha};
  IntentionBwdParams p;
  fill_inputs(p.in, s, qc, kc, vc, mask, scale);
  p.grad_out = go.data_ptr(), p.factor = fc.const_data_ptr<float>(), p.weights = wc.const_data_ptr<float>();
  p.grad_q = dq.data_ptr(), p.grad_k = dk.data_ptr(), p.grad_v = v.has_value() ? dv.data_ptr() : nullptr;
  p.grad_alpha = dalpha.data_ptr<float>(), p.db = db.data_ptr<float>(), p.e = e.data_ptr<float>();
  check_plan(plan_intention_bwd(p, smem_limit_of(q.device(), op)), op,
             [&] { return c10::str("q ", q.sizes(), ", k ", k.sizes()); });
  const c10::cuda::CUDAGuard guard(q.device());
  check_launch(launch_intention_bwd(p, at::cuda::getCurrentCUDAStream()), op);
  return {dq, dk, dv, dalpha};
}

std::tuple<at::Tensor, at::Tensor> batched_cholesky_cuda(const at::Tensor& a) {
  const char* op = "batched_cholesky";
  check_square_matrices(op, "A", a);
  check_cholesky_dtype(op, "A", a);
  check_is_cuda(a, "A", op);
  const ScalarType dtype = *scalar_type_of(a.scalar_type());
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
  check_plan(plan_batched_cholesky(batch, n, -1, dtype, smem_limit_of(a.device(), op)), op,
             [&] { return c10::str("A ", a.sizes(), " ", a.scalar_type()); });
  const c10::cuda::CUDAGuard guard(a.device());
  check_launch(launch_batched_cholesky(p, at::cuda::getCurrentCUDAStream()), op);
  return {l, info};
}

at::Tensor batched_cholesky_solve_cuda(const at::Tensor& l, const at::Tensor& b) {
  const char* op = "batched_cholesky_solve";
  check_cholesky_solve_inputs(op, "L", l, b);
  check_is_cuda(l, "L", op);
  check_on_device(b, "B", l.device(), op);
  const ScalarType dtype = *scalar_type_of(l.scalar_type());
  const int64_t n = l.size(-1), r = b.size(-1);
  TORCH_CHECK_VALUE(n <= kCholeskyMaxDim, "attn_ext.batched_cholesky_solve (CUDA): n must be <= ", kCholeskyMaxDim,
                    ", got L of shape ", l.sizes());
  at::Tensor x = at::empty(b.sizes(), b.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t batch = x.numel() == 0 ? 0 : x.numel() / (n * r);
  if (batch == 0) return x;
  check_plan(plan_batched_cholesky(batch, n, r, dtype, smem_limit_of(l.device(), op)), op,
             [&] { return c10::str("L ", l.sizes(), " ", l.scalar_type(), ", B ", b.sizes()); });
  BatchedCholeskySolveParams p;
  at::Tensor l3, b3;
  p.l = as_matrices(l, batch, l3);
  p.b = as_matrices(b, batch, b3);
  p.x = x.data_ptr(), p.batch = batch, p.n = n, p.r = r, p.dtype = dtype;
  const c10::cuda::CUDAGuard guard(l.device());
  check_launch(launch_batched_cholesky_solve(p, at::cuda::getCurrentCUDAStream()), op);
  return x;
}

}  // namespace cuda
}  // namespace attn_ext
