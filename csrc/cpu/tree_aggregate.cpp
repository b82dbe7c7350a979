// CPU masked-mean aggregation of a Tree Cross Attention tree (docs/spec.md §3 "Aggregate") and its backward.
//
// The reference (attn_ext/tree/aggregate.py) gathers the leaves, masks them, reduces each level and
// concatenates: some eight passes of [B, L, E] through memory. Here both directions walk the tree
// depth first with one row of sums per level (fp32 for fp16/bf16): each token row is read once and
// each node row written once, in a sequential sweep of every level's id range of the subtree, and
// nothing of the output's size is allocated besides the output itself.
//
// The parallel tasks are the subtrees rooted at the "cut" level, the shallowest level with enough
// roots over the batch to keep every thread busy; the few levels above the cut are done afterwards
// from the roots' (fp32) values. A node always sums its children in order, so the result does not
// depend on the cut, i.e. on the number of threads.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "checks/common.h"
#include "checks/tree_checks.h"
#include "ops.h"

namespace attn_ext::cpu {
namespace {

// More tasks than threads: subtrees over the padding at the end of the leaves are cheaper.
constexpr int64_t kTasksPerThread = 4;
// Below ~64K elements per task waking other threads costs more than the copy.
constexpr int64_t kElementsPerTask = int64_t(1) << 16;

struct Layout {
  int64_t batch, tokens, dim, branching, height, group_size, leaf_offset, leaves, nodes;
  std::vector<int64_t> offset;  // first id of levels 0 … height, then the leaf offset G
  int64_t cut;

  int64_t width(int64_t level) const { return offset[level + 1] - offset[level]; }
};

/// The walk's view of a checked call: the tree's level offsets and the level whose subtrees are
/// the parallel tasks.
Layout make_layout(const TreeAggregateSizes& t) {
  Layout s{t.batch, t.tokens, t.dim, t.branching, t.height, t.group_size, t.ids.leaf_offset, t.ids.leaves,
           t.ids.nodes, std::vector<int64_t>(t.height + 2, 0), 0};
  int64_t width = 1;
  for (int64_t level = 0; level <= s.height; ++level) {
    s.offset[level + 1] = s.offset[level] + width;
    if (level < s.height) width *= s.branching;
  }
  const int64_t wanted = kTasksPerThread * at::get_num_threads();
  for (int64_t roots = s.batch; s.cut < s.height && roots < wanted; roots *= s.branching) ++s.cut;
  return s;
}

/// The dtypes the CPU kernels take (the CUDA ones refuse fp64): checked here, the rest is shared.
void check_payload_dtype(const at::Tensor& x, const char* name) {
  const at::ScalarType t = x.scalar_type();
  TORCH_CHECK_TYPE(t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble, "attn_ext: ", name,
                   " dtype ", t, " is not supported; use float16, bfloat16, float32 or float64");
}

int64_t grain_for(const Layout& s) {
  const int64_t per_task = std::max<int64_t>(1, s.nodes / s.width(s.cut) * s.dim);
  return std::max<int64_t>(1, kElementsPerTask / per_task);
}

template <typename T>
inline void zero_row(T* x, int64_t n) {
  std::fill(x, x + n, T(0));
}

template <typename acc_t, typename T>
inline void add_row(acc_t* sum, const T* x, int64_t n) {
  for (int64_t d = 0; d < n; ++d) sum[d] += static_cast<acc_t>(x[d]);
}

template <typename scalar_t>
struct ForwardWalk {
  using acc_t = acc_type<scalar_t>;
  const Layout& s;
  const scalar_t* values;
  int64_t values_batch_stride, values_token_stride;
  const int64_t* leaf_token;
  const bool* mask;
  scalar_t* out;
  std::atomic<bool>& bad_token;

  // `sum` of the valid children → their mean (0 for a padding node or one without valid children),
  // kept in `sum` for the parent and stored in the node's row.
  void finish(int64_t e, int64_t id, int64_t count, acc_t* sum) const {
    scalar_t* row = out + (e * s.nodes + id) * s.dim;
    if (mask[e * s.nodes + id] || count == 0) {
      zero_row(sum, s.dim);
      zero_row(row, s.dim);
      return;
    }
    const acc_t c = static_cast<acc_t>(count);
    for (int64_t d = 0; d < s.dim; ++d) {
      sum[d] /= c;
      row[d] = static_cast<scalar_t>(sum[d]);
    }
  }

  void group(int64_t e, int64_t g, acc_t* sum) const {
    zero_row(sum, s.dim);
    int64_t count = 0;
    const bool* leaf_pad = mask + e * s.nodes + s.leaf_offset;
    const int64_t* tokens = leaf_token + e * s.leaves;
    for (int64_t slot = g * s.group_size; slot < (g + 1) * s.group_size; ++slot) {
      scalar_t* row = out + (e * s.nodes + s.leaf_offset + slot) * s.dim;
      const int64_t t = tokens[slot];
      if (leaf_pad[slot] || t < 0 || t >= s.tokens) {
        // Only a valid slot must name a token; a bad one is reported after the parallel region.
        if (!leaf_pad[slot]) bad_token.store(true, std::memory_order_relaxed);
        zero_row(row, s.dim);
        continue;
      }
      const scalar_t* x = values + e * values_batch_stride + t * values_token_stride;
      for (int64_t d = 0; d < s.dim; ++d) {
        row[d] = x[d];
        sum[d] += static_cast<acc_t>(x[d]);
      }
      ++count;
    }
    finish(e, s.offset[s.height] + g, count, sum);
  }

  // Node `index` of `level` and everything below it; its value is left in sums[level].
  void subtree(int64_t e, int64_t level, int64_t index, acc_t* sums) const {
    acc_t* sum = sums + level * s.dim;
    if (level == s.height) return group(e, index, sum);
    const acc_t* child = sum + s.dim;
    const int64_t id = s.offset[level] + index;
    const bool* child_pad = mask + e * s.nodes + s.branching * id + 1;
    zero_row(sum, s.dim);
    int64_t count = 0;
    for (int64_t j = 0; j < s.branching; ++j) {
      subtree(e, level + 1, index * s.branching + j, sums);
      if (!child_pad[j]) {
        add_row(sum, child, s.dim);
        ++count;
      }
    }
    finish(e, id, count, sum);
  }
};

template <typename scalar_t>
struct BackwardWalk {
  using acc_t = acc_type<scalar_t>;
  const Layout& s;
  const scalar_t* grad;
  int64_t grad_batch_stride, grad_node_stride;
  const int64_t* leaf_token;
  const int64_t* token_leaf;
  const bool* mask;
  scalar_t* grad_values;
  std::atomic<bool>& bad_token;

  const scalar_t* grad_row(int64_t e, int64_t id) const {
    return grad + e * grad_batch_stride + id * grad_node_stride;
  }

  // What each valid child of node `id` receives: the node's total gradient (its own plus
  // `from_parent`, nullptr for none) over its valid-child count. False when nothing flows down
  // (a padding node, or one without valid children, whose value is a constant 0).
  bool share_of(int64_t e, int64_t level, int64_t id, const acc_t* from_parent, acc_t* share) const {
    const bool* pad = mask + e * s.nodes;
    if (pad[id]) return false;
    const bool group = level == s.height;
    const int64_t first = group ? s.leaf_offset + (id - s.offset[level]) * s.group_size : s.branching * id + 1;
    const int64_t children = group ? s.group_size : s.branching;
    int64_t count = 0;
    for (int64_t j = 0; j < children; ++j) count += !pad[first + j];
    if (count == 0) return false;
    const scalar_t* g = grad_row(e, id);
    const acc_t c = static_cast<acc_t>(count);
    if (from_parent != nullptr) {
      for (int64_t d = 0; d < s.dim; ++d) share[d] = (static_cast<acc_t>(g[d]) + from_parent[d]) / c;
    } else {
      for (int64_t d = 0; d < s.dim; ++d) share[d] = static_cast<acc_t>(g[d]) / c;
    }
    return true;
  }

  // The tokens of group `g`: each gets its leaf slot's own gradient plus the group's share.
  // Returns how many tokens it wrote, for the caller's check that every token was.
  int64_t group(int64_t e, int64_t g, const acc_t* share) const {
    const bool* leaf_pad = mask + e * s.nodes + s.leaf_offset;
    const int64_t* tokens = leaf_token + e * s.leaves;
    int64_t written = 0;
    for (int64_t slot = g * s.group_size; slot < (g + 1) * s.group_size; ++slot) {
      const int64_t t = tokens[slot];
      if (t < 0) continue;
      if (t >= s.tokens || token_leaf[e * s.tokens + t] != slot) {
        bad_token.store(true, std::memory_order_relaxed);
        continue;
      }
      ++written;
      scalar_t* dst = grad_values + (e * s.tokens + t) * s.dim;
      if (leaf_pad[slot]) {
        zero_row(dst, s.dim);
        continue;
      }
      const scalar_t* own = grad_row(e, s.leaf_offset + slot);
      if (share != nullptr) {
        for (int64_t d = 0; d < s.dim; ++d) dst[d] = static_cast<scalar_t>(static_cast<acc_t>(own[d]) + share[d]);
      } else {
        std::copy(own, own + s.dim, dst);
      }
    }
    return written;
  }

  // Node `index` of `level` and everything below it; shares[level] holds its share while below runs.
  int64_t subtree(int64_t e, int64_t level, int64_t index, const acc_t* from_parent, acc_t* shares) const {
    acc_t* share = shares + level * s.dim;
    const acc_t* down = share_of(e, level, s.offset[level] + index, from_parent, share) ? share : nullptr;
    if (level == s.height) return group(e, index, down);
    int64_t written = 0;
    for (int64_t j = 0; j < s.branching; ++j) written += subtree(e, level + 1, index * s.branching + j, down, shares);
    return written;
  }
};

}  // namespace

at::Tensor tree_aggregate_fwd_cpu(const at::Tensor& leaf_values, const at::Tensor& leaf_token,
                                  const at::Tensor& node_padding_mask, int64_t branching, int64_t height,
                                  int64_t group_size) {
  const Layout s = make_layout(
      check_tree_aggregate_fwd_inputs(leaf_values, leaf_token, node_padding_mask, branching, height, group_size));
  check_payload_dtype(leaf_values, "leaf_values [B, N, E]");
  const at::Tensor values = with_unit_inner_stride(leaf_values);
  const at::Tensor tokens = leaf_token.contiguous(), pad = node_padding_mask.contiguous();
  at::Tensor out = at::empty({s.batch, s.nodes, s.dim}, values.options());
  std::atomic<bool> bad_token{false};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "attn_ext::tree_aggregate_fwd",
                                  [&] {
    using acc_t = acc_type<scalar_t>;
    const ForwardWalk<scalar_t> walk{s, values.const_data_ptr<scalar_t>(), values.stride(0), values.stride(1),
                                     tokens.const_data_ptr<int64_t>(), pad.const_data_ptr<bool>(),
                                     out.mutable_data_ptr<scalar_t>(), bad_token};
    const int64_t E = s.dim, cut = s.cut, width = s.width(cut), above = s.offset[cut + 1];
    // Values of levels 0 … cut per batch entry, kept in acc_t so the top levels round only once.
    std::vector<acc_t> top(s.batch * above * E);
    at::parallel_for(0, s.batch * width, grain_for(s), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> sums((s.height + 1) * E);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t e = task / width, index = task % width;
        walk.subtree(e, cut, index, sums.data());
        std::copy(sums.begin() + cut * E, sums.begin() + (cut + 1) * E,
                  top.begin() + (e * above + s.offset[cut] + index) * E);
      }
    });
    for (int64_t level = cut - 1; level >= 0; --level) {
      for (int64_t e = 0; e < s.batch; ++e) {
        const bool* pad_row = pad.const_data_ptr<bool>() + e * s.nodes;
        for (int64_t id = s.offset[level]; id < s.offset[level + 1]; ++id) {
          acc_t* sum = top.data() + (e * above + id) * E;
          zero_row(sum, E);
          int64_t count = 0;
          for (int64_t child = branching * id + 1; child <= branching * id + branching; ++child) {
            if (pad_row[child]) continue;
            add_row(sum, top.data() + (e * above + child) * E, E);
            ++count;
          }
          walk.finish(e, id, count, sum);
        }
      }
    }
  });
  TORCH_CHECK_VALUE(!bad_token.load(), "attn_ext: leaf_token names a token outside [0, N = ", s.tokens,
                    ") at a non-padding leaf slot");
  return out;
}

at::Tensor tree_aggregate_bwd_cpu(const at::Tensor& grad_nodes, const at::Tensor& leaf_token,
                                  const at::Tensor& token_leaf, const at::Tensor& node_padding_mask,
                                  int64_t branching, int64_t height, int64_t group_size, int64_t num_tokens) {
  const Layout s = make_layout(check_tree_aggregate_bwd_inputs(grad_nodes, leaf_token, token_leaf, node_padding_mask,
                                                               branching, height, group_size, num_tokens));
  check_payload_dtype(grad_nodes, "grad_nodes [B, num_nodes, E]");
  const at::Tensor grad = with_unit_inner_stride(grad_nodes);
  const at::Tensor tokens = leaf_token.contiguous(), slots = token_leaf.contiguous(),
                   pad = node_padding_mask.contiguous();
  at::Tensor grad_values = at::empty({s.batch, num_tokens, s.dim}, grad.options());
  std::atomic<bool> bad_token{false};
  std::atomic<int64_t> written{0};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "attn_ext::tree_aggregate_bwd",
                                  [&] {
    using acc_t = acc_type<scalar_t>;
    const BackwardWalk<scalar_t> walk{s, grad.const_data_ptr<scalar_t>(), grad.stride(0), grad.stride(1),
                                      tokens.const_data_ptr<int64_t>(), slots.const_data_ptr<int64_t>(),
                                      pad.const_data_ptr<bool>(), grad_values.mutable_data_ptr<scalar_t>(),
                                      bad_token};
    const int64_t E = s.dim, cut = s.cut, width = s.width(cut), above = s.offset[cut];
    // Shares of the levels above the cut, top-down (has_share: something flows down from the node).
    std::vector<acc_t> top(s.batch * above * E);
    std::vector<char> has_share(s.batch * above, 0);
    for (int64_t level = 0; level < cut; ++level) {
      for (int64_t e = 0; e < s.batch; ++e) {
        for (int64_t id = s.offset[level]; id < s.offset[level + 1]; ++id) {
          const int64_t parent = e * above + (id - 1) / branching;
          const acc_t* from_parent = level > 0 && has_share[parent] ? top.data() + parent * E : nullptr;
          has_share[e * above + id] = walk.share_of(e, level, id, from_parent, top.data() + (e * above + id) * E);
        }
      }
    }
    at::parallel_for(0, s.batch * width, grain_for(s), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> shares((s.height + 1) * E);
      int64_t count = 0;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t e = task / width, index = task % width;
        const int64_t parent = e * above + (s.offset[cut] + index - 1) / branching;
        const acc_t* from_parent = cut > 0 && has_share[parent] ? top.data() + parent * E : nullptr;
        count += walk.subtree(e, cut, index, from_parent, shares.data());
      }
      written.fetch_add(count, std::memory_order_relaxed);
    });
  });
  TORCH_CHECK_VALUE(!bad_token.load() && written.load() == s.batch * num_tokens,
                    "attn_ext: leaf_token [B, L] and token_leaf [B, N] must be inverse maps, every one of the N = ",
                    num_tokens, " tokens at exactly one leaf slot (-1 at the padding slots)");
  return grad_values;
}

}  // namespace attn_ext::cpu
