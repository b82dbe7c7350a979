// Typed wrappers of the CUDA Tree Cross Attention and tree aggregation kernels (docs/spec.md §3):
// tree_cross_attention_fwd/_bwd and tree_aggregate_fwd/_bwd for CUDA tensors (declared in ops.h,
// registered in registration.cpp). Inputs are validated by the checks the CPU ops use
// (csrc/checks/tree_checks.h, same messages); outputs have the CPU ops' shapes and dtypes. Compiled
// only against a CUDA build of torch.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>
#include <tuple>

#include "checks/common.h"
#include "checks/tree_checks.h"
#include "cuda/tree_aggregate.cuh"
#include "cuda/tree_cross_attention.cuh"
#include "ops.h"
#include "tensor_checks.h"

namespace attn_ext {
namespace cuda {
namespace {

using namespace bindings;  // tensor_checks.h: dtype mapping, device checks, mask bytes, launch errors

/// The unpacked inputs of a tree attention call (kept alive while the kernel's params point at them).
struct TreeInputs {
  at::Tensor q, k, v, mask;
  TreeShape shape;    ///< as checked (shared with the CPU op)
  TreeShapeParams s;  ///< as the kernels take it
};

TreeInputs prepare_tree(const at::Tensor& q, const at::Tensor& node_k, const at::Tensor& node_v,
                        const at::Tensor& node_padding_mask, int64_t branching, int64_t height, int64_t group_size,
                        double scale, const std::optional<at::Tensor>& uniforms, bool backward, const char* op) {
  const TreeShape t =
      check_tree_inputs(q, node_k, node_v, node_padding_mask, branching, height, group_size, scale, uniforms);
  check_is_cuda(q, "tensors", op);
  TreeInputs in;
  in.shape = t;
  in.q = with_unit_inner_stride(q), in.k = with_unit_inner_stride(node_k), in.v = with_unit_inner_stride(node_v);
  in.mask = mask_bytes(node_padding_mask);
  TreeShapeParams& s = in.s;
  s.B = t.batch, s.H = t.heads, s.M = t.queries, s.D = t.head_dim, s.Dv = t.value_dim, s.nodes = t.nodes;
  s.branching = t.branching, s.height = t.height, s.group_size = t.group_size;
  s.group_offset = t.group_offset, s.leaf_offset = t.leaf_offset, s.selected = t.selected;
  fill_qkv_layout(s, in.q, in.k, in.v, in.mask, scale, kernel_scalar_type(q.scalar_type(), op));
  const TreeLaunchPlan plan = plan_tree_cross_attention(s.B, s.M, s.H, s.D, s.Dv, s.branching, s.group_size, s.height,
                                                        backward, smem_limit_of(q.device(), op));
  check_plan(plan, op, [&] {
    return c10::str("q ", q.sizes(), ", node_v ", node_v.sizes(), ", branching ", branching, ", group_size ",
                    group_size, ", height ", height);
  });
  return in;
}

/// The kernels' view of an aggregation call checked by the shared rules, after the CUDA-only checks:
/// the payload's dtype and device, and the grid.
TreeAggregateShape aggregate_shape(const TreeAggregateSizes& t, const at::Tensor& payload, const char* name,
                                   const char* op) {
  TreeAggregateShape s;
  s.B = t.batch, s.tokens = t.tokens, s.E = t.dim;
  s.branching = t.branching, s.height = t.height, s.group_size = t.group_size;
  s.group_offset = t.ids.group_offset, s.leaf_offset = t.ids.leaf_offset, s.nodes = t.ids.nodes;
  s.dtype = kernel_scalar_type(payload.scalar_type(), op);
  check_is_cuda(payload, name, op);
  TORCH_CHECK_VALUE(plan_tree_aggregate(s.B * s.nodes, s.E).supported, "attn_ext.", op,
                    " (CUDA): too many nodes or features for the CUDA grid, got ", name, " ", payload.sizes());
  return s;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> tree_cross_attention_fwd_cuda(
    const at::Tensor& q, const at::Tensor& node_k, const at::Tensor& node_v, const at::Tensor& node_padding_mask,
    int64_t branching, int64_t height, int64_t group_size, double scale, const std::optional<at::Tensor>& uniforms) {
  const char* op = "tree_cross_attention_fwd";
  const TreeInputs in =
      prepare_tree(q, node_k, node_v, node_padding_mask, branching, height, group_size, scale, uniforms, false, op);
  const TreeShapeParams& s = in.s;
  const at::ScalarType acc_dtype = accumulation_dtype(q.scalar_type());
  const auto acc = q.options().dtype(acc_dtype);
  const at::Tensor u = uniforms.has_value() ? uniforms->to(acc_dtype).contiguous() : at::Tensor();
  at::Tensor out = at::empty({s.B, s.H, s.M, s.Dv}, q.options());
  at::Tensor lse = at::empty({s.B, s.H, s.M}, acc);
  at::Tensor selected = at::empty({s.B, s.M, s.selected}, q.options().dtype(at::kLong));
  at::Tensor log_prob = at::empty({s.B, s.M}, acc);
  at::Tensor entropy = at::empty({s.B, s.M}, acc);
  if (s.B * s.M == 0) return {out, lse, selected, log_prob, entropy};
  TreeFwdParams p;
  p.s = s, p.q = in.q.data_ptr(), p.node_k = in.k.data_ptr(), p.node_v = in.v.data_ptr();
  p.node_padding_mask = in.mask.const_data_ptr<uint8_t>(), p.uniforms = u.defined() ? u.const_data_ptr<float>() : nullptr;
  p.out = out.data_ptr(), p.lse = lse.data_ptr<float>(), p.selected = selected.data_ptr<int64_t>();
  p.log_prob = log_prob.data_ptr<float>(), p.entropy = entropy.data_ptr<float>();
  const c10::cuda::CUDAGuard guard(q.device());
  check_launch(launch_tree_cross_attention_fwd(p, at::cuda::getCurrentCUDAStream()), op);
  return {out, lse, selected, log_prob, entropy};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_cross_attention_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& grad_log_prob,
    const at::Tensor& grad_entropy, const at::Tensor& q, const at::Tensor& node_k, const at::Tensor& node_v,
    const at::Tensor& node_padding_mask, const at::Tensor& selected, const at::Tensor& lse, int64_t branching,
    int64_t height, int64_t group_size, double scale) {
  const char* op = "tree_cross_attention_bwd";
  const TreeInputs in = prepare_tree(q, node_k, node_v, node_padding_mask, branching, height, group_size, scale,
                                     std::nullopt, true, op);
  const TreeShapeParams& s = in.s;
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{grad_out, "grad_out"}, {grad_lse, "grad_lse"},
                                {grad_log_prob, "grad_log_prob"}, {grad_entropy, "grad_entropy"},
                                {selected, "selected"}, {lse, "lse"}}) {
    check_on_device(t, name, q.device(), op);
  }
  // Also validates the ids (one synchronisation, as on the CPU): the kernel indexes node arrays with
  // them and rebuilds each path from the first id of the group's leaves.
  check_tree_bwd_inputs(in.shape, grad_out, grad_lse, grad_log_prob, grad_entropy, selected, lse);
  const at::ScalarType acc_dtype = accumulation_dtype(q.scalar_type());
  const auto acc = q.options().dtype(acc_dtype);
  auto as_acc = [&](const at::Tensor& t) { return t.to(acc_dtype).contiguous(); };
  const at::Tensor go = grad_out.to(q.scalar_type()).contiguous(), sel = selected.contiguous();
  const at::Tensor glse = as_acc(grad_lse), glp = as_acc(grad_log_prob), gent = as_acc(grad_entropy);
  const at::Tensor lse_c = as_acc(lse);
  at::Tensor dq = at::zeros({s.B, s.H, s.M, s.D}, q.options());
  at::Tensor dk = at::zeros({s.B, s.H, s.nodes, s.D}, acc);  // fp32 atomics, cast at the end
  at::Tensor dv = at::zeros({s.B, s.H, s.nodes, s.Dv}, acc);
  if (s.B * s.H * s.M > 0) {
    TreeBwdParams p;
    p.s = s, p.grad_out = go.data_ptr(), p.grad_lse = glse.const_data_ptr<float>();
    p.grad_log_prob = glp.const_data_ptr<float>(), p.grad_entropy = gent.const_data_ptr<float>();
    p.q = in.q.data_ptr(), p.node_k = in.k.data_ptr(), p.node_v = in.v.data_ptr();
    p.node_padding_mask = in.mask.const_data_ptr<uint8_t>(), p.selected = sel.const_data_ptr<int64_t>();
    p.lse = lse_c.const_data_ptr<float>(), p.grad_q = dq.data_ptr();
    p.grad_node_k = dk.data_ptr<float>(), p.grad_node_v = dv.data_ptr<float>();
    const c10::cuda::CUDAGuard guard(q.device());
    check_launch(launch_tree_cross_attention_bwd(p, at::cuda::getCurrentCUDAStream()), op);
  }
  return {dq, dk.to(q.scalar_type()), dv.to(q.scalar_type())};
}

at::Tensor tree_aggregate_fwd_cuda(const at::Tensor& leaf_values, const at::Tensor& leaf_token,
                                   const at::Tensor& node_padding_mask, int64_t branching, int64_t height,
                                   int64_t group_size) {
  const char* op = "tree_aggregate_fwd";
  const TreeAggregateShape s = aggregate_shape(
      check_tree_aggregate_fwd_inputs(leaf_values, leaf_token, node_padding_mask, branching, height, group_size),
      leaf_values, "leaf_values [B, N, E]", op);
  const at::Tensor values = with_unit_inner_stride(leaf_values);
  const at::Tensor lt = leaf_token.contiguous(), mask = mask_bytes(node_padding_mask);
  at::Tensor out = at::empty({s.B, s.nodes, s.E}, leaf_values.options());
  if (s.B == 0 || s.E == 0) return out;
  at::Tensor means =
      at::empty({s.B, s.leaf_offset, s.E}, leaf_values.options().dtype(accumulation_dtype(leaf_values.scalar_type())));
  at::Tensor bad = at::zeros({1}, leaf_values.options().dtype(at::kInt));
  TreeAggregateFwdParams p;
  p.s = s, p.leaf_values = values.data_ptr(), p.values_stride_b = values.stride(0), p.values_stride_n = values.stride(1);
  p.leaf_token = lt.const_data_ptr<int64_t>(), p.node_padding_mask = mask.const_data_ptr<uint8_t>();
  p.out = out.data_ptr(), p.means = means.data_ptr<float>(), p.bad = bad.data_ptr<int32_t>();
  const c10::cuda::CUDAGuard guard(leaf_values.device());
  check_launch(launch_tree_aggregate_fwd(p, at::cuda::getCurrentCUDAStream()), op);
  TORCH_CHECK_VALUE(bad.item<int32_t>() == 0, "attn_ext: leaf_token names a token outside [0, N = ", s.tokens,
                    ") at a non-padding leaf slot");
  return out;
}

at::Tensor tree_aggregate_bwd_cuda(const at::Tensor& grad_nodes, const at::Tensor& leaf_token,
                                   const at::Tensor& token_leaf, const at::Tensor& node_padding_mask,
                                   int64_t branching, int64_t height, int64_t group_size, int64_t num_tokens) {
  const char* op = "tree_aggregate_bwd";
  const TreeAggregateShape s = aggregate_shape(check_tree_aggregate_bwd_inputs(grad_nodes, leaf_token, token_leaf,
                                                                               node_padding_mask, branching, height,
                                                                               group_size, num_tokens),
                                               grad_nodes, "grad_nodes [B, num_nodes, E]", op);
  const at::Tensor grad = with_unit_inner_stride(grad_nodes);
  const at::Tensor lt = leaf_token.contiguous(), tl = token_leaf.contiguous(), mask = mask_bytes(node_padding_mask);
  at::Tensor grad_values = at::empty({s.B, num_tokens, s.E}, grad_nodes.options());
  if (s.B == 0) return grad_values;
  at::Tensor shares =
      at::empty({s.B, s.leaf_offset, s.E}, grad_nodes.options().dtype(accumulation_dtype(grad_nodes.scalar_type())));
  at::Tensor bad = at::zeros({1}, grad_nodes.options().dtype(at::kInt));
  TreeAggregateBwdParams p;
  p.s = s, p.grad_nodes = grad.data_ptr(), p.grad_stride_b = grad.stride(0), p.grad_stride_n = grad.stride(1);
  p.leaf_token = lt.const_data_ptr<int64_t>(), p.token_leaf = tl.const_data_ptr<int64_t>();
  p.node_padding_mask = mask.const_data_ptr<uint8_t>(), p.grad_values = grad_values.data_ptr();
  p.shares = shares.data_ptr<float>(), p.bad = bad.data_ptr<int32_t>();
  const c10::cuda::CUDAGuard guard(grad_nodes.device());
  check_launch(launch_tree_aggregate_bwd(p, at::cuda::getCurrentCUDAStream()), op);
  TORCH_CHECK_VALUE(bad.item<int32_t>() == 0,
                    "attn_ext: leaf_token [B, L] and token_leaf [B, N] must be inverse maps, every one of the N = ",
                    num_tokens, " tokens at exactly one leaf slot (-1 at the padding slots)");
  return grad_values;
}

}  // namespace cuda
}  // namespace attn_ext
