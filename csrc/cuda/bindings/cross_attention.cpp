// Typed wrappers of the CUDA chunked cross-attention kernels (docs/spec.md §1): cross_attention_fwd/_bwd and
// merge_states_fwd/_bwd for CUDA tensors (declared in ops.h, registered in registration.cpp). Inputs
// are validated by the checks the CPU ops use (csrc/checks/cross_attention_checks.h, same messages);
// outputs have the CPU ops' shapes and dtypes. Compiled only against a CUDA build of torch.
//
// chunk_size is validated but otherwise unused here: the kernels stream the keys in their own tiles,
// and the result does not depend on the chunking (it is the exact softmax either way).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>
#include <tuple>

#include "checks/cross_attention_checks.h"
#include "cuda/cross_attention_bwd.cuh"
#include "cuda/cross_attention_fwd.cuh"
#include "cuda/merge_states.cuh"
#include "ops.h"
#include "tensor_checks.h"

namespace attn_ext {
namespace cuda {
namespace {

using namespace bindings;  // tensor_checks.h: dtype mapping, device checks, mask bytes, launch errors

/// The unpacked inputs of a call (kept alive while the kernel's params point at them).
struct AttentionInputs {
  at::Tensor q, k, v, mask;
  CrossAttentionShape s;
  ScalarType dtype;
};

AttentionInputs prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const std::optional<at::Tensor>& key_padding_mask, double scale, int64_t chunk_size,
                        const char* op) {
  AttentionInputs in;
  in.s = check_cross_attention_inputs(q, k, v, key_padding_mask, scale, chunk_size);
  check_is_cuda(q, "tensors", op);
  in.dtype = kernel_scalar_type(q.scalar_type(), op);
  in.q = with_unit_inner_stride(q), in.k = with_unit_inner_stride(k), in.v = with_unit_inner_stride(v);
  if (key_padding_mask.has_value()) in.mask = mask_bytes(*key_padding_mask);
  return in;
}

/// Fills the fields the forward and backward params share (the two structs name them alike).
template <typename Params>
void fill_inputs(Params& p, const AttentionInputs& in, double scale) {
  const CrossAttentionShape& s = in.s;
  p.B = s.batch, p.H = s.heads, p.M = s.queries, p.N = s.keys, p.D = s.head_dim, p.Dv = s.value_dim;
  p.q = in.q.data_ptr(), p.k = in.k.data_ptr(), p.v = in.v.data_ptr();
  if (in.mask.defined()) p.key_padding_mask = in.mask.const_data_ptr<uint8_t>();
  fill_qkv_layout(p, in.q, in.k, in.v, in.mask, scale, in.dtype);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> cross_attention_fwd_cuda(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v,
                                                            const std::optional<at::Tensor>& key_padding_mask,
                                                            double scale, int64_t chunk_size) {
  const char* op = "cross_attention_fwd";
  const AttentionInputs in = prepare(q, k, v, key_padding_mask, scale, chunk_size, op);
  const CrossAttentionShape& s = in.s;
  const CrossAttentionLaunchPlan plan = plan_cross_attention_fwd(s.batch, s.heads, s.queries, s.keys, s.head_dim,
                                                                 s.value_dim, in.dtype, smem_limit_of(q.device(), op),
                                                                 capability_of(q.device(), op));
  check_plan(plan, op, [&] { return c10::str("q ", q.sizes(), " ", q.scalar_type(), ", v ", v.sizes()); });
  at::Tensor out = at::empty({s.batch, s.heads, s.queries, s.value_dim}, q.options());
  at::Tensor lse = at::empty({s.batch, s.heads, s.queries}, q.options().dtype(accumulation_dtype(q.scalar_type())));
  if (plan.empty) return {out, lse};
  CrossAttentionFwdParams p;
  fill_inputs(p, in, scale);
  p.out = out.data_ptr(), p.lse = lse.data_ptr<float>();
  const c10::cuda::CUDAGuard guard(q.device());
  check_launch(launch_cross_attention_fwd(p, at::cuda::getCurrentCUDAStream()), op);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_attention_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const std::optional<at::Tensor>& key_padding_mask, const at::Tensor& out,
    const at::Tensor& lse, double scale, int64_t chunk_size) {
  const char* op = "cross_attention_bwd";
  const AttentionInputs in = prepare(q, k, v, key_padding_mask, scale, chunk_size, op);
  const CrossAttentionShape& s = in.s;
  check_cross_attention_grads(s, q, grad_out, grad_lse, out, lse);
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{grad_out, "grad_out"},
                                {grad_lse, "grad_lse"}, {out, "out"}, {lse, "lse"}}) {
    check_on_device(t, name, q.device(), op);
  }
  const CrossAttentionBwdPlan plan = plan_cross_attention_bwd(s.batch, s.heads, s.queries, s.keys, s.head_dim,
                                                              s.value_dim, in.dtype, smem_limit_of(q.device(), op),
                                                              capability_of(q.device(), op));
  check_plan(plan, op, [&] { return c10::str("q ", q.sizes(), " ", q.scalar_type(), ", v ", v.sizes()); });
  const at::Tensor o = with_unit_inner_stride(out), go = with_unit_inner_stride(grad_out);
  const at::Tensor lse_c = lse.contiguous(), glse_c = grad_lse.contiguous();
  at::Tensor grad_q = at::empty({s.batch, s.heads, s.queries, s.head_dim}, q.options());
  at::Tensor grad_k = at::empty({s.batch, s.heads, s.keys, s.head_dim}, k.options());
  at::Tensor grad_v = at::empty({s.batch, s.heads, s.keys, s.value_dim}, v.options());
  at::Tensor delta = at::empty({s.batch, s.heads, s.queries}, q.options().dtype(accumulation_dtype(q.scalar_type())));
  CrossAttentionBwdParams p;
  fill_inputs(p, in, scale);
  p.out = o.data_ptr(), p.grad_out = go.data_ptr();
  p.out_stride_b = o.stride(0), p.out_stride_h = o.stride(1), p.out_stride_m = o.stride(2);
  p.dout_stride_b = go.stride(0), p.dout_stride_h = go.stride(1), p.dout_stride_m = go.stride(2);
  p.lse = lse_c.const_data_ptr<float>(), p.grad_lse = glse_c.const_data_ptr<float>();
  p.delta = delta.data_ptr<float>();
  p.grad_q = grad_q.data_ptr(), p.grad_k = grad_k.data_ptr(), p.grad_v = grad_v.data_ptr();
  const c10::cuda::CUDAGuard guard(q.device());
  check_launch(launch_cross_attention_bwd(p, at::cuda::getCurrentCUDAStream()), op);
  return {grad_q, grad_k, grad_v};
}

std::tuple<at::Tensor, at::Tensor> merge_states_fwd_cuda(const at::Tensor& out_a, const at::Tensor& lse_a,
                                                         const at::Tensor& out_b, const at::Tensor& lse_b) {
  const char* op = "merge_states_fwd";
  const MergeStateRows s = check_merge_states(out_a, lse_a, out_b, lse_b);
  check_is_cuda(out_a, "tensors", op);
  const at::Tensor oa = out_a.contiguous(), ob = out_b.contiguous(), la = lse_a.contiguous(), lb = lse_b.contiguous();
  at::Tensor out = at::empty_like(oa);
  at::Tensor lse = at::empty_like(la);
  MergeStatesParams p;
  p.out_a = oa.data_ptr(), p.out_b = ob.data_ptr(), p.lse_a = la.const_data_ptr<float>();
  p.lse_b = lb.const_data_ptr<float>(), p.out = out.data_ptr(), p.lse = lse.data_ptr<float>();
  p.rows = s.rows, p.Dv = s.dv, p.dtype = kernel_scalar_type(oa.scalar_type(), op);
  const c10::cuda::CUDAGuard guard(out_a.device());
  check_launch(launch_merge_states_fwd(p, at::cuda::getCurrentCUDAStream()), op);
  return {out, lse};
}

/// The merge's backward is a handful of elementwise ops and one row sum: composed from ATen CUDA ops
/// in the accumulation dtype rather than a hand-written kernel. w = exp(lse_x − lse) is the share of side x (0 for an
/// empty merged row, guarding (−inf) − (−inf)); grad_out_x = w·g, grad_lse_x = w·(g·(o_x − o) + dlse).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> merge_states_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& out_a, const at::Tensor& lse_a,
    const at::Tensor& out_b, const at::Tensor& lse_b, const at::Tensor& out, const at::Tensor& lse) {
  const char* op = "merge_states_bwd";
  check_merge_states(out_a, lse_a, out_b, lse_b);
  check_merge_states_grads(grad_out, grad_lse, out, lse, out_a, lse_a);
  check_is_cuda(out_a, "tensors", op);
  kernel_scalar_type(out_a.scalar_type(), op);
  const c10::cuda::CUDAGuard guard(out_a.device());
  const at::ScalarType acc = accumulation_dtype(out_a.scalar_type());
  const at::Tensor g = grad_out.to(acc), o = out.to(acc);
  const at::Tensor empty_row = at::isneginf(lse);
  const auto side = [&](const at::Tensor& out_x, const at::Tensor& lse_x) {
    const at::Tensor w = at::where(empty_row, at::zeros_like(lse), at::exp(lse_x - lse));
    at::Tensor grad_out_x = (w.unsqueeze(-1) * g).to(out_x.scalar_type());
    at::Tensor grad_lse_x = w * ((g * (out_x.to(acc) - o)).sum(-1) + grad_lse);
    return std::make_pair(grad_out_x, grad_lse_x);
  };
  auto [grad_out_a, grad_lse_a] = side(out_a, lse_a);
  auto [grad_out_b, grad_lse_b] = side(out_b, lse_b);
  return {grad_out_a, grad_lse_a, grad_out_b, grad_lse_b};
}

}  // namespace cuda
}  // namespace attn_ext
