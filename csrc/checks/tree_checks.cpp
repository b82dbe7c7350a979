#include "checks/tree_checks.h"

#include <cmath>
#include <vector>

namespace attn_ext {
namespace {

int64_t int_pow(int64_t base, int64_t exp) {
  int64_t r = 1;
  for (int64_t i = 0; i < exp; ++i) r *= base;
  return r;
}

/// The payload's first dims and the tree tensors of an aggregation call, the same for both directions.
TreeAggregateSizes check_aggregate_tree(const at::Tensor& payload, const char* name, int64_t tokens,
                                        const at::Tensor& leaf_token, const at::Tensor& mask, int64_t branching,
                                        int64_t height, int64_t group_size) {
  TORCH_CHECK_VALUE(payload.dim() == 3, "attn_ext: ", name, " must be 3-D, got ", payload.sizes());
  TORCH_CHECK_VALUE(branching >= 2, "attn_ext: branching must be >= 2, got ", branching);
  TORCH_CHECK_VALUE(height >= 0 && height <= 62, "attn_ext: height must be in [0, 62], got ", height);
  TORCH_CHECK_VALUE(group_size >= 1, "attn_ext: group_size must be >= 1, got ", group_size);
  TORCH_CHECK_VALUE(tree_ids_fit(branching, height, group_size), "attn_ext: a tree of branching ", branching,
                    ", height ", height, " and group size ", group_size, " is too large");
  const TreeAggregateSizes s{payload.size(0), tokens, payload.size(2), branching, height, group_size,
                             tree_ids(branching, height, group_size)};
  TORCH_CHECK_TYPE(leaf_token.scalar_type() == at::kLong, "attn_ext: leaf_token must be int64, got ",
                   leaf_token.scalar_type());
  TORCH_CHECK_VALUE(leaf_token.dim() == 2 && leaf_token.size(0) == s.batch && leaf_token.size(1) == s.ids.leaves,
                    "attn_ext: leaf_token must be [B, group_size·branching^height] = [", s.batch, ", ", s.ids.leaves,
                    "] for branching ", branching, ", height ", height, ", group size ", group_size, "; got ",
                    leaf_token.sizes());
  TORCH_CHECK_TYPE(mask.scalar_type() == at::kBool, "attn_ext: node_padding_mask must be bool (True = padding), got ",
                   mask.scalar_type());
  TORCH_CHECK_VALUE(mask.dim() == 2 && mask.size(0) == s.batch && mask.size(1) == s.ids.nodes,
                    "attn_ext: node_padding_mask must be [B, num_nodes] = [", s.batch, ", ", s.ids.nodes, "], got ",
                    mask.sizes());
  TORCH_CHECK(leaf_token.device() == payload.device() && mask.device() == payload.device(),
              "attn_ext: tree tensors must be on the values' device ", payload.device(), "; got leaf_token on ",
              leaf_token.device(), ", node_padding_mask on ", mask.device());
  return s;
}

}  // namespace

bool tree_ids_fit(int64_t branching, int64_t height, int64_t group_size) {
  // In double: b^(k+1)·P itself may not fit in int64.
  double nodes = static_cast<double>(group_size);
  for (int64_t i = 0; i <= height; ++i) nodes *= static_cast<double>(branching);
  return nodes < 4e18;
}

TreeIds tree_ids(int64_t branching, int64_t height, int64_t group_size) {
  TreeIds t;
  const int64_t groups = int_pow(branching, height);
  t.group_offset = (groups - 1) / (branching - 1);
  t.leaf_offset = t.group_offset + groups;
  t.leaves = groups * group_size;
  t.nodes = t.leaf_offset + t.leaves;
  t.selected = height * (branching - 1) + group_size;
  return t;
}

TreeShape check_tree_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                            int64_t branching, int64_t height, int64_t group_size, double scale,
                            const std::optional<at::Tensor>& uniforms) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "attn_ext: q, node_k, node_v must be 4-D [B, H, M, D], [B, H, num_nodes, D], [B, H, num_nodes, Dv]; got q ",
              q.sizes(), ", node_k ", k.sizes(), ", node_v ", v.sizes());
  TORCH_CHECK(branching >= 2, "attn_ext: branching must be >= 2, got ", branching);
  TORCH_CHECK(height >= 0 && height <= 62, "attn_ext: height must be in [0, 62], got ", height);
  TORCH_CHECK(group_size >= 1, "attn_ext: group_size must be >= 1, got ", group_size);
  TORCH_CHECK(std::isfinite(scale), "attn_ext: scale must be finite, got ", scale);
  TORCH_CHECK(tree_ids_fit(branching, height, group_size), "attn_ext: a tree of branching ", branching, ", height ",
              height, " and group size ", group_size, " is too large");
  const TreeIds ids = tree_ids(branching, height, group_size);
  TreeShape s;
  s.batch = q.size(0);
  s.heads = q.size(1);
  s.queries = q.size(2);
  s.head_dim = q.size(3);
  s.value_dim = v.size(3);
  s.branching = branching;
  s.height = height;
  s.group_size = group_size;
  s.group_offset = ids.group_offset;
  s.leaf_offset = ids.leaf_offset;
  s.nodes = ids.nodes;
  s.selected = ids.selected;
  TORCH_CHECK(k.size(0) == s.batch && k.size(1) == s.heads && k.size(2) == s.nodes && k.size(3) == s.head_dim &&
                  v.size(0) == s.batch && v.size(1) == s.heads && v.size(2) == s.nodes,
              "attn_ext: node_k must be [B, H, num_nodes, D] = [", s.batch, ", ", s.heads, ", ", s.nodes, ", ",
              s.head_dim, "] and node_v [B, H, num_nodes, Dv] for q ", q.sizes(), " and a tree with branching ",
              branching, ", height ", height, ", group size ", group_size, "; got node_k ", k.sizes(), ", node_v ",
              v.sizes());
  TORCH_CHECK(s.head_dim > 0, "attn_ext: head dim D must be positive, got q ", q.sizes());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() && q.is_floating_point(),
              "attn_ext: q, node_k, node_v must share a floating dtype; got ", q.scalar_type(), ", ", k.scalar_type(),
              ", ", v.scalar_type());
  TORCH_CHECK(mask.scalar_type() == at::kBool, "attn_ext: node_padding_mask must be bool (True = padding), got ",
              mask.scalar_type());
  TORCH_CHECK(mask.dim() == 2 && mask.size(0) == s.batch && mask.size(1) == s.nodes,
              "attn_ext: node_padding_mask must be [B, num_nodes] = [", s.batch, ", ", s.nodes, "], got ",
              mask.sizes());
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device() && q.device() == mask.device(),
              "attn_ext: q, node_k, node_v, node_padding_mask must be on one device; got ", q.device(), ", ",
              k.device(), ", ", v.device(), ", ", mask.device());
  if (uniforms.has_value()) {
    const at::Tensor& u = *uniforms;
    TORCH_CHECK(u.is_floating_point(), "attn_ext: uniforms must be a floating tensor, got ", u.scalar_type());
    TORCH_CHECK(u.dim() == 3 && u.size(0) == s.batch && u.size(1) == s.queries && u.size(2) == height,
                "attn_ext: uniforms must be [B, M, height] = [", s.batch, ", ", s.queries, ", ", height, "], got ",
                u.sizes());
    TORCH_CHECK(u.device() == q.device(), "attn_ext: uniforms are on ", u.device(), " but q on ", q.device());
  }
  return s;
}

void check_tree_bwd_inputs(const TreeShape& s, const at::Tensor& grad_out, const at::Tensor& grad_lse,
                           const at::Tensor& grad_log_prob, const at::Tensor& grad_entropy,
                           const at::Tensor& selected, const at::Tensor& lse) {
  const std::vector<int64_t> rows{s.batch, s.heads, s.queries}, units{s.batch, s.queries};
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef({s.batch, s.heads, s.queries, s.value_dim}),
              "attn_ext: grad_out must be [B, H, M, Dv] = ", at::IntArrayRef({s.batch, s.heads, s.queries, s.value_dim}),
              ", got ", grad_out.sizes());
  TORCH_CHECK(grad_lse.sizes() == at::IntArrayRef(rows) && lse.sizes() == at::IntArrayRef(rows),
              "attn_ext: lse and grad_lse must be [B, H, M] = ", at::IntArrayRef(rows), ", got ", lse.sizes(), " and ",
              grad_lse.sizes());
  TORCH_CHECK(grad_log_prob.sizes() == at::IntArrayRef(units) && grad_entropy.sizes() == at::IntArrayRef(units),
              "attn_ext: grad_log_prob and grad_entropy must be [B, M] = ", at::IntArrayRef(units), ", got ",
              grad_log_prob.sizes(), " and ", grad_entropy.sizes());
  TORCH_CHECK(selected.scalar_type() == at::kLong &&
                  selected.sizes() == at::IntArrayRef({s.batch, s.queries, s.selected}),
              "attn_ext: selected must be int64 [B, M, S] = ", at::IntArrayRef({s.batch, s.queries, s.selected}),
              ", got ", selected.scalar_type(), " ", selected.sizes());
  if (selected.numel() == 0) return;
  const int64_t lo = selected.min().item<int64_t>(), hi = selected.max().item<int64_t>();
  TORCH_CHECK(lo >= 0 && hi < s.nodes, "attn_ext: selected holds node ids in [", lo, ", ", hi,
              "], outside the tree's [0, ", s.nodes, ")");
  const int64_t leaf_lo = selected.select(2, s.selected - s.group_size).min().item<int64_t>();
  TORCH_CHECK(leaf_lo >= s.leaf_offset, "attn_ext: selected[..., S - group_size] must be leaf ids (>= ",
              s.leaf_offset, "), got ", leaf_lo);
}

TreeAggregateSizes check_tree_aggregate_fwd_inputs(const at::Tensor& leaf_values, const at::Tensor& leaf_token,
                                                   const at::Tensor& node_padding_mask, int64_t branching,
                                                   int64_t height, int64_t group_size) {
  const int64_t tokens = leaf_values.dim() == 3 ? leaf_values.size(1) : 0;
  return check_aggregate_tree(leaf_values, "leaf_values [B, N, E]", tokens, leaf_token, node_padding_mask, branching,
                              height, group_size);
}

TreeAggregateSizes check_tree_aggregate_bwd_inputs(const at::Tensor& grad_nodes, const at::Tensor& leaf_token,
                                                   const at::Tensor& token_leaf, const at::Tensor& node_padding_mask,
                                                   int64_t branching, int64_t height, int64_t group_size,
                                                   int64_t num_tokens) {
  TORCH_CHECK_VALUE(num_tokens >= 0, "attn_ext: num_tokens must be >= 0, got ", num_tokens);
  const TreeAggregateSizes s = check_aggregate_tree(grad_nodes, "grad_nodes [B, num_nodes, E]", num_tokens, leaf_token,
                                                    node_padding_mask, branching, height, group_size);
  TORCH_CHECK_VALUE(grad_nodes.size(1) == s.ids.nodes,
                    "attn_ext: grad_nodes must be [B, num_nodes, E] with num_nodes = ", s.ids.nodes, ", got ",
                    grad_nodes.sizes());
  TORCH_CHECK_TYPE(token_leaf.scalar_type() == at::kLong, "attn_ext: token_leaf must be int64, got ",
                   token_leaf.scalar_type());
  TORCH_CHECK_VALUE(token_leaf.dim() == 2 && token_leaf.size(0) == s.batch && token_leaf.size(1) == num_tokens,
                    "attn_ext: token_leaf must be [B, num_tokens] = [", s.batch, ", ", num_tokens, "], got ",
                    token_leaf.sizes());
  TORCH_CHECK(token_leaf.device() == grad_nodes.device(), "attn_ext: token_leaf is on ", token_leaf.device(),
              " but grad_nodes on ", grad_nodes.device());
  return s;
}

}  // namespace attn_ext
