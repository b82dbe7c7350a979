// Runs the CUDA tree aggregation kernels' source on the host (cuda_emulation/) level by level, as
// tree_aggregate.cu launches them, against a recursive double-precision masked mean; the backward
// against the exact gradient of that (linear) reference. Covers padded leaves and whole padded
// subtrees, permuted tokens, E > 128 (two column blocks), height 0, and broken token maps.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <vector>

#include "check.h"
#include "emulator_extras_tree.h"
#include "tree_aggregate_kernel.cuh"

namespace {

using namespace attn_ext::cuda;
namespace det = attn_ext::cuda::detail;

struct Tree {
  TreeAggregateShape s;
  std::vector<int64_t> leaf_token, token_leaf;
  std::vector<uint8_t> mask;
};

int64_t level_first(int64_t b, int64_t level, int64_t* width) {
  int64_t w = 1;
  for (int64_t i = 0; i < level; ++i) w *= b;
  *width = w;
  return (w - 1) / (b - 1);
}

Tree make_tree(int64_t B, int64_t tokens, int64_t E, int64_t b, int64_t height, int64_t P, std::mt19937& gen) {
  Tree t;
  TreeAggregateShape& s = t.s;
  s.B = B, s.tokens = tokens, s.E = E, s.branching = b, s.height = height, s.group_size = P;
  int64_t groups = 0;
  s.group_offset = level_first(b, height, &groups);
  s.leaf_offset = s.group_offset + groups;
  s.nodes = s.leaf_offset + groups * P;
  const int64_t leaves = groups * P;
  t.leaf_token.assign(B * leaves, -1), t.token_leaf.assign(B * tokens, -1), t.mask.assign(B * s.nodes, 1);
  for (int64_t e = 0; e < B; ++e) {
    // Tokens on a random subset of the slots (batch 0: the first `tokens` slots, as build_tree does).
    std::vector<int64_t> slots(leaves);
    for (int64_t i = 0; i < leaves; ++i) slots[i] = i;
    if (e > 0) std::shuffle(slots.begin(), slots.end(), gen);
    for (int64_t t_ = 0; t_ < tokens; ++t_) {
      t.leaf_token[e * leaves + slots[t_]] = t_;
      t.token_leaf[e * tokens + t_] = slots[t_];
    }
    uint8_t* mk = t.mask.data() + e * s.nodes;
    for (int64_t i = 0; i < leaves; ++i) mk[s.leaf_offset + i] = t.leaf_token[e * leaves + i] < 0;
    for (int64_t g = groups - 1; g >= 0; --g) {
      bool all = true;
      for (int64_t j = 0; j < P; ++j) all = all && mk[s.leaf_offset + g * P + j];
      mk[s.group_offset + g] = all;
    }
    for (int64_t id = s.group_offset - 1; id >= 0; --id) {
      bool all = true;
      for (int64_t j = 1; j <= b; ++j) all = all && mk[id * b + j];
      mk[id] = all;
    }
  }
  return t;
}

/// Recursive masked mean in double: node values [B, nodes, E].
std::vector<double> reference(const Tree& t, const std::vector<double>& values) {
  const TreeAggregateShape& s = t.s;
  const int64_t leaves = s.nodes - s.leaf_offset;
  std::vector<double> out(s.B * s.nodes * s.E, 0.0);
  for (int64_t e = 0; e < s.B; ++e) {
    const uint8_t* mk = t.mask.data() + e * s.nodes;
    for (int64_t i = 0; i < leaves; ++i) {
      const int64_t tok = t.leaf_token[e * leaves + i];
      if (mk[s.leaf_offset + i] || tok < 0) continue;
      for (int64_t d = 0; d < s.E; ++d) out[(e * s.nodes + s.leaf_offset + i) * s.E + d] = values[(e * s.tokens + tok) * s.E + d];
    }
    for (int64_t id = s.leaf_offset - 1; id >= 0; --id) {
      const bool group = id >= s.group_offset;
      const int64_t first = group ? s.leaf_offset + (id - s.group_offset) * s.group_size : id * s.branching + 1;
      const int64_t n = group ? s.group_size : s.branching;
      int64_t count = 0;
      std::vector<double> sum(s.E, 0.0);
      for (int64_t j = 0; j < n; ++j) {
        if (mk[first + j]) continue;
        ++count;
        for (int64_t d = 0; d < s.E; ++d) sum[d] += out[(e * s.nodes + first + j) * s.E + d];
      }
      if (mk[id] || count == 0) continue;
      for (int64_t d = 0; d < s.E; ++d) out[(e * s.nodes + id) * s.E + d] = sum[d] / count;
    }
  }
  return out;
}

void emulate(const TreeLaunchPlan& plan, const std::function<void()>& call) {
  CHECK(plan.supported);
  if (plan.empty) return;
  CHECK(cuda_emu::run_grid(dim3(plan.grid.x, plan.grid.y), dim3(plan.block.x), det::smem_raw, sizeof(det::smem_raw), 0,
                           call));
}

void run_case(const char* name, int64_t B, int64_t tokens, int64_t E, int64_t b, int64_t height, int64_t P, uint32_t seed,
              bool break_maps) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> normal;
  Tree t = make_tree(B, tokens, E, b, height, P, gen);
  const TreeAggregateShape& s = t.s;
  std::vector<double> values(B * tokens * E);
  for (double& x : values) x = double(float(normal(gen)));
  // Values stored with a padded token stride (E + 3).
  std::vector<float> vals(B * tokens * (E + 3), 1e30f);
  for (int64_t i = 0; i < B * tokens; ++i)
    for (int64_t d = 0; d < E; ++d) vals[i * (E + 3) + d] = float(values[i * E + d]);
  std::vector<float> out(B * s.nodes * E, 7.0f), means(B * s.leaf_offset * E, 7.0f);
  int32_t bad = 0;
  TreeAggregateFwdParams p;
  p.s = s, p.leaf_values = vals.data(), p.values_stride_b = tokens * (E + 3), p.values_stride_n = E + 3;
  p.leaf_token = t.leaf_token.data(), p.node_padding_mask = t.mask.data(), p.out = out.data(), p.means = means.data();
  p.bad = &bad;
  for (int64_t level = s.height; level >= 0; --level) {  // as tree_aggregate.cu
    int64_t width = 0;
    const int64_t first = level_first(s.branching, level, &width);
    emulate(plan_tree_aggregate(B * width, E), [&] { det::tree_aggregate_level_kernel<float>(p, first, width, level == s.height); });
  }
  CHECK(bad == 0);
  const std::vector<double> want = reference(t, values);
  int mismatches = 0;
  for (size_t i = 0; i < out.size(); ++i) mismatches += !(std::fabs(out[i] - want[i]) <= 1e-6 * (1 + std::fabs(want[i])));

  // Backward: grad_values = Jᵀ grad_nodes, J from the (linear) reference, column by column.
  std::vector<float> gn(B * s.nodes * E), gv(B * tokens * E, 7.0f), shares(B * s.leaf_offset * E, 7.0f);
  for (float& x : gn) x = float(normal(gen));
  if (break_maps && tokens > 1) std::swap(t.token_leaf[0], t.token_leaf[1]);
  TreeAggregateBwdParams g;
  g.s = s, g.grad_nodes = gn.data(), g.grad_stride_b = s.nodes * E, g.grad_stride_n = E;
  g.leaf_token = t.leaf_token.data(), g.token_leaf = t.token_leaf.data(), g.node_padding_mask = t.mask.data();
  g.grad_values = gv.data(), g.shares = shares.data(), g.bad = &bad;
  const int64_t slots = B * (s.nodes - s.leaf_offset);
  TreeLaunchPlan check;
  check.supported = true, check.grid.x = static_cast<unsigned int>((slots + 127) / 128), check.block.x = 128;
  emulate(check, [&] { det::tree_aggregate_slot_check_kernel(g); });
  for (int64_t level = 0; level <= s.height; ++level) {
    int64_t width = 0;
    const int64_t first = level_first(s.branching, level, &width);
    emulate(plan_tree_aggregate(B * width, E), [&] { det::tree_aggregate_share_kernel<float>(g, first, width, level == s.height); });
  }
  emulate(plan_tree_aggregate(B * tokens, E), [&] { det::tree_aggregate_token_kernel<float>(g); });
  if (break_maps) {
    CHECK(bad == 1);
  } else {
    CHECK(bad == 0);
    for (int64_t i = 0; i < B * tokens * E; ++i) {
      std::vector<double> unit(values.size(), 0.0);
      unit[i] = 1.0;
      const std::vector<double> col = reference(t, unit);
      double want_g = 0;
      for (size_t j = 0; j < col.size(); ++j) want_g += col[j] * gn[j];
      mismatches += !(std::fabs(gv[i] - want_g) <= 1e-5 * (1 + std::fabs(want_g)));
    }
  }
  std::printf("  %-40s nodes=%lld ok=%s\n", name, (long long)s.nodes, mismatches ? "NO" : "yes");
  CHECK(mismatches == 0);
}

}  // namespace

int main() {
  CHECK(plan_tree_aggregate(10, 200).grid.y == 2);
  CHECK(plan_tree_aggregate(0, 5).empty);
  run_case("b=2 height=3 P=3 E=5, 17 of 24 slots", 2, 17, 5, 2, 3, 3, 1, false);
  run_case("b=3 height=2 P=2 E=130 (two column blocks)", 2, 10, 130, 3, 2, 2, 2, false);
  run_case("height 0, P=4", 3, 3, 7, 2, 0, 4, 3, false);
  run_case("token_leaf not the inverse of leaf_token", 1, 6, 3, 2, 2, 2, 4, true);
  if (attn_ext_tests::g_failures != 0) {
    std::fprintf(stderr, "attn_ext_cuda_tree_aggregate_emulation_tests: %d failure(s)\n", attn_ext_tests::g_failures);
    return 1;
  }
  std::printf("attn_ext_cuda_tree_aggregate_emulation_tests: all cases passed\n");
  return 0;
}
