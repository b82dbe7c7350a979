// Typed wrappers of the CUDA state merge for CUDA tensors (declared in ops.h, registered in
// registration.cpp): merge_states_fwd/_bwd (docs/spec.md §1 merge). Inputs are validated by the checks
// the CPU ops use (csrc/checks/attention_checks.h, same messages); outputs have the CPU ops' shapes and
// dtypes. Compiled only against a CUDA build of torch.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <tuple>
#include <utility>

#include "checks/attention_checks.h"
#include "cuda/merge_states.cuh"
#include "ops.h"
#include "tensor_checks.h"

namespace attn_ext {
namespace cuda {

using namespace bindings;  // tensor_checks.h: dtype mapping, device checks, launch errors

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
