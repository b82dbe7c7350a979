// Torch bindings of the CUDA Tree Cross Attention and tree aggregation kernels (SPEC §3):
// tree_cross_attention_fwd/_bwd and tree_aggregate_fwd/_bwd for CUDA tensors (schemas in
// csrc/ops.cpp). The attention ops validate with the CPU op's check_tree_inputs (same messages);
// outputs have the CPU ops' shapes and dtypes. Compiled only against a CUDA build of torch.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "cpu/tree_shape.h"
#include "cuda/tree_aggregate.cuh"
#include "cuda/tree_cross_attention.cuh"
#include "tensor_checks.h"

namespace attn_ext {
namespace cuda {
namespace {

using bindings::check_launch;
using bindings::check_on_device;
using bindings::kernel_scalar_type;
using bindings::mask_bytes;
using bindings::with_unit_inner_stride;

/// The unpacked inputs of a tree attention call (kept alive while the kernel's params point at them).
struct TreeInputs {
  at::Tensor q, k, v, mask;
  TreeShapeParams s;
};

TreeInputs prepare_tree(const at::Tensor& q, const at::Tensor& node_k, const at::Tensor& node_v,
                        const at::Tensor& node_padding_mask, int64_t branching, int64_t height, int64_t group_size,
                        double scale, const std::optional<at::Tensor>& uniforms, bool backward, const char* op) {
  const cpu::TreeShape t =
      cpu::check_tree_inputs(q, node_k, node_v, node_padding_mask, branching, height, group_size, scale, uniforms);
  TORCH_CHECK(q.is_cuda(), "attn_ext.", op, ": the CUDA kernel got tensors on ", q.device());
  TreeInputs in;
  in.q = with_unit_inner_stride(q), in.k = with_unit_inner_stride(node_k), in.v = with_unit_inner_stride(node_v);
  in.mask = mask_bytes(node_padding_mask);
  TreeShapeParams& s = in.s;
  s.B = t.batch, s.H = t.heads, s.M = t.queries, s.D = t.head_dim, s.Dv = t.value_dim, s.nodes = t.nodes;
  s.branching = t.branching, s.height = t.height, s.group_size = t.group_size;
  s.group_offset = t.group_offset, s.leaf_offset = t.leaf_offset, s.selected = t.selected;
  s.q_stride_b = in.q.stride(0), s.q_stride_h = in.q.stride(1), s.q_stride_m = in.q.stride(2);
  s.k_stride_b = in.k.stride(0), s.k_stride_h = in.k.stride(1), s.k_stride_n = in.k.stride(2);
  s.v_stride_b = in.v.stride(0), s.v_stride_h = in.v.stride(1), s.v_stride_n = in.v.stride(2);
  s.mask_stride_b = in.mask.stride(0);
  s.scale = static_cast<float>(scale);
  s.dtype = kernel_scalar_type(q.scalar_type(), op);
  const TreeLaunchPlan plan =
      plan_tree_cross_attention(s.B, s.M, s.H, s.D, s.Dv, s.branching, s.group_size, s.height, backward);
  TORCH_CHECK_VALUE(plan.supported, "attn_ext.", op, " (CUDA): ", plan.error, "; got q ", q.sizes(), ", node_v ",
                    node_v.sizes(), ", branching ", branching, ", group_size ", group_size, ", height ", height);
  return in;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> tree_cross_attention_fwd_cuda(
    const at::Tensor& q, const at::Tensor& node_k, const at::Tensor& node_v, const at::Tensor& node_padding_mask,
    int64_t branching, int64_t height, int64_t group_size, double scale, const std::optional<at::Tensor>& uniforms) {
  const char* op = "tree_cross_attention_fwd";
  const TreeInputs in =
      prepare_tree(q, node_k, node_v, node_padding_mask, branching, height, group_size, scale, uniforms, false, op);
  const TreeShapeParams& s = in.s;
  const auto f32 = q.options().dtype(at::kFloat);
  const at::Tensor u = uniforms.has_value() ? uniforms->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor out = at::empty({s.B, s.H, s.M, s.Dv}, q.options());
  at::Tensor lse = at::empty({s.B, s.H, s.M}, f32);
  at::Tensor selected = at::empty({s.B, s.M, s.selected}, q.options().dtype(at::kLong));
  at::Tensor log_prob = at::empty({s.B, s.M}, f32);
  at::Tensor entropy = at::empty({s.B, s.M}, f32);
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
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef({s.B, s.H, s.M, s.Dv}), "attn_ext: grad_out must be [B, H, M, Dv] = ",
              at::IntArrayRef({s.B, s.H, s.M, s.Dv}), ", got ", grad_out.sizes());
  TORCH_CHECK(grad_lse.sizes() == at::IntArrayRef({s.B, s.H, s.M}) && lse.sizes() == at::IntArrayRef({s.B, s.H, s.M}),
              "attn_ext: lse and grad_lse must be [B, H, M] = ", at::IntArrayRef({s.B, s.H, s.M}), ", got ",
              lse.sizes(), " and ", grad_lse.sizes());
  TORCH_CHECK(grad_log_prob.sizes() == at::IntArrayRef({s.B, s.M}) &&
                  grad_entropy.sizes() == at::IntArrayRef({s.B, s.M}),
              "attn_ext: grad_log_prob and grad_entropy must be [B, M] = ", at::IntArrayRef({s.B, s.M}), ", got ",
              grad_log_prob.sizes(), " and ", grad_entropy.sizes());
  TORCH_CHECK(selected.scalar_type() == at::kLong && selected.sizes() == at::IntArrayRef({s.B, s.M, s.selected}),
              "attn_ext: selected must be int64 [B, M, S] = ", at::IntArrayRef({s.B, s.M, s.selected}), ", got ",
              selected.scalar_type(), " ", selected.sizes());
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{grad_out, "grad_out"}, {grad_lse, "grad_lse"},
                                {grad_log_prob, "grad_log_prob"}, {grad_entropy, "grad_entropy"},
                                {selected, "selected"}, {lse, "lse"}}) {
    check_on_device(t, name, q.device(), op);
  }
  const auto f32 = q.options().dtype(at::kFloat);
  auto as_f32 = [](const at::Tensor& t) { return t.to(at::kFloat).contiguous(); };
  const at::Tensor go = grad_out.to(q.scalar_type()).contiguous(), sel = selected.contiguous();
  const at::Tensor glse = as_f32(grad_lse), glp = as_f32(grad_log_prob), gent = as_f32(grad_entropy);
  const at::Tensor lse_c = as_f32(lse);
  at::Tensor dq = at::zeros({s.B, s.H, s.M, s.D}, q.options());
  at::Tensor dk = at::zeros({s.B, s.H, s.nodes, s.D}, f32);  // fp32 atomics, cast at the end
  at::Tensor dv = at::zeros({s.B, s.H, s.nodes, s.Dv}, f32);
  if (s.B * s.H * s.M > 0) {
    // Validate the ids once (one synchronisation, as the CPU op): the kernel indexes node arrays with
    // them and rebuilds each path from the first id of the group's leaves.
    const int64_t lo = sel.min().item<int64_t>(), hi = sel.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < s.nodes, "attn_ext: selected holds node ids in [", lo, ", ", hi,
                "], outside the tree's [0, ", s.nodes, ")");
    const int64_t leaf_lo = sel.select(2, s.selected - s.group_size).min().item<int64_t>();
    TORCH_CHECK(leaf_lo >= s.leaf_offset, "attn_ext: selected[..., S - group_size] must be leaf ids (>= ",
                s.leaf_offset, "), got ", leaf_lo);
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

/// The tree of an aggregation call, validated with the CPU op's rules and messages.
TreeAggregateShape aggregate_shape(const at::Tensor& payload, const char* name, int64_t tokens, int64_t branching,
                                   int64_t height, int64_t group_size, const at::Tensor& leaf_token,
                                   const at::Tensor& mask, const char* op) {
  TORCH_CHECK_VALUE(payload.dim() == 3, "attn_ext: ", name, " must be 3-D, got ", payload.sizes());
  TORCH_CHECK_VALUE(branching >= 2, "attn_ext: branching must be >= 2, got ", branching);
  TORCH_CHECK_VALUE(height >= 0 && height <= 62, "attn_ext: height must be in [0, 62], got ", height);
  TORCH_CHECK_VALUE(group_size >= 1, "attn_ext: group_size must be >= 1, got ", group_size);
  double nodes_d = static_cast<double>(group_size);
  for (int64_t i = 0; i <= height; ++i) nodes_d *= static_cast<double>(branching);
  TORCH_CHECK_VALUE(nodes_d < 4e18, "attn_ext: a tree of branching ", branching, ", height ", height,
                    " and group size ", group_size, " is too large");
  TreeAggregateShape s;
  s.B = payload.size(0), s.tokens = tokens, s.E = payload.size(2);
  s.branching = branching, s.height = height, s.group_size = group_size;
  int64_t groups = 1;
  for (int64_t i = 0; i < height; ++i) groups *= branching;
  s.group_offset = (groups - 1) / (branching - 1);
  s.leaf_offset = s.group_offset + groups;
  s.nodes = s.leaf_offset + groups * group_size;
  s.dtype = kernel_scalar_type(payload.scalar_type(), op);
  const int64_t leaves = groups * group_size;
  TORCH_CHECK_TYPE(leaf_token.scalar_type() == at::kLong, "attn_ext: leaf_token must be int64, got ",
                   leaf_token.scalar_type());
  TORCH_CHECK_VALUE(leaf_token.dim() == 2 && leaf_token.size(0) == s.B && leaf_token.size(1) == leaves,
                    "attn_ext: leaf_token must be [B, group_size·branching^height] = [", s.B, ", ", leaves,
                    "] for branching ", branching, ", height ", height, ", group size ", group_size, "; got ",
                    leaf_token.sizes());
  TORCH_CHECK_TYPE(mask.scalar_type() == at::kBool, "attn_ext: node_padding_mask must be bool (True = padding), got ",
                   mask.scalar_type());
  TORCH_CHECK_VALUE(mask.dim() == 2 && mask.size(0) == s.B && mask.size(1) == s.nodes,
                    "attn_ext: node_padding_mask must be [B, num_nodes] = [", s.B, ", ", s.nodes, "], got ",
                    mask.sizes());
  TORCH_CHECK(payload.is_cuda(), "attn_ext.", op, ": the CUDA kernel got ", name, " on ", payload.device());
  check_on_device(leaf_token, "leaf_token", payload.device(), op);
  check_on_device(mask, "node_padding_mask", payload.device(), op);
  TORCH_CHECK_VALUE(plan_tree_aggregate(s.B * s.nodes, s.E).supported, "attn_ext.", op,
                    " (CUDA): too many nodes or features for the CUDA grid, got ", name, " ", payload.sizes());
  return s;
}

at::Tensor tree_aggregate_fwd_cuda(const at::Tensor& leaf_values, const at::Tensor& leaf_token,
                                   const at::Tensor& node_padding_mask, int64_t branching, int64_t height,
                                   int64_t group_size) {
  const char* op = "tree_aggregate_fwd";
  const int64_t tokens = leaf_values.dim() == 3 ? leaf_values.size(1) : 0;
  const TreeAggregateShape s = aggregate_shape(leaf_values, "leaf_values [B, N, E]", tokens, branching, height,
                                               group_size, leaf_token, node_padding_mask, op);
  const at::Tensor values = with_unit_inner_stride(leaf_values);
  const at::Tensor lt = leaf_token.contiguous(), mask = mask_bytes(node_padding_mask);
  at::Tensor out = at::empty({s.B, s.nodes, s.E}, leaf_values.options());
  if (s.B == 0 || s.E == 0) return out;
  at::Tensor means = at::empty({s.B, s.leaf_offset, s.E}, leaf_values.options().dtype(at::kFloat));
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
  TORCH_CHECK_VALUE(num_tokens >= 0, "attn_ext: num_tokens must be >= 0, got ", num_tokens);
  const TreeAggregateShape s = aggregate_shape(grad_nodes, "grad_nodes [B, num_nodes, E]", num_tokens, branching,
                                               height, group_size, leaf_token, node_padding_mask, op);
  TORCH_CHECK_VALUE(grad_nodes.size(1) == s.nodes, "attn_ext: grad_nodes must be [B, num_nodes, E] with num_nodes = ",
                    s.nodes, ", got ", grad_nodes.sizes());
  TORCH_CHECK_TYPE(token_leaf.scalar_type() == at::kLong, "attn_ext: token_leaf must be int64, got ",
                   token_leaf.scalar_type());
  TORCH_CHECK_VALUE(token_leaf.dim() == 2 && token_leaf.size(0) == s.B && token_leaf.size(1) == num_tokens,
                    "attn_ext: token_leaf must be [B, num_tokens] = [", s.B, ", ", num_tokens, "], got ",
                    token_leaf.sizes());
  check_on_device(token_leaf, "token_leaf", grad_nodes.device(), op);
  const at::Tensor grad = with_unit_inner_stride(grad_nodes);
  const at::Tensor lt = leaf_token.contiguous(), tl = token_leaf.contiguous(), mask = mask_bytes(node_padding_mask);
  at::Tensor grad_values = at::empty({s.B, num_tokens, s.E}, grad_nodes.options());
  if (s.B == 0) return grad_values;
  at::Tensor shares = at::empty({s.B, s.leaf_offset, s.E}, grad_nodes.options().dtype(at::kFloat));
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

}  // namespace
}  // namespace cuda
}  // namespace attn_ext

TORCH_LIBRARY_IMPL(attn_ext, CUDA, m) {
  m.impl("tree_cross_attention_fwd", &attn_ext::cuda::tree_cross_attention_fwd_cuda);
  m.impl("tree_cross_attention_bwd", &attn_ext::cuda::tree_cross_attention_bwd_cuda);
  m.impl("tree_aggregate_fwd", &attn_ext::cuda::tree_aggregate_fwd_cuda);
  m.impl("tree_aggregate_bwd", &attn_ext::cuda::tree_aggregate_bwd_cuda);
}
