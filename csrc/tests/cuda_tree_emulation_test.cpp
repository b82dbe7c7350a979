// Runs the CUDA Tree Cross Attention forward and backward kernels' source on the host
// (cuda_emulation/) against a brute-force double-precision descent + attention: greedy and sampled
// descents, padded leaves and nodes (holding NaN, which must never reach an output), b = 2 and 3,
// height 0, a non-multiple-of-4 query count (inactive warps), strided q, and the NaN rule. The backward is checked
// against central finite differences of the same double reference with the path held fixed.
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "check.h"
#include "emulator_extras_tree.h"
#include "tree_cross_attention_bwd_kernel.cuh"
#include "tree_cross_attention_fwd_kernel.cuh"

namespace {

using namespace attn_ext::cuda;

/// sm_90's opt-in shared memory per block, the default device of the cases.
constexpr std::size_t kSm90 = 232448;
namespace det = attn_ext::cuda::detail;

struct Case {
  const char* name;
  int64_t B, H, M, D, Dv, b, height, P;
  bool sample, check_backward;
};

struct Tree {
  int64_t B, H, M, D, Dv, b, height, P, nodes, group_offset, leaf_offset, S;
  std::vector<double> q, k, v;  // logical [B,H,M,D], [B,H,nodes,D], [B,H,nodes,Dv]
  std::vector<uint8_t> mask;    // [B, nodes]
  std::vector<float> u;         // [B, M, height] or empty
  double scale;
};

struct Result {
  std::vector<double> out, lse, lp, ent;
  std::vector<int64_t> sel;
};

int64_t ipow(int64_t a, int64_t e) {
  int64_t r = 1;
  while (e-- > 0) r *= a;
  return r;
}

/// Brute-force forward in double; with `fixed` the choices follow the given selected sets.
Result reference(const Tree& t, const std::vector<int64_t>* fixed) {
  Result r;
  r.out.assign(t.B * t.H * t.M * t.Dv, 0.0), r.lse.assign(t.B * t.H * t.M, 0.0);
  r.lp.assign(t.B * t.M, 0.0), r.ent.assign(t.B * t.M, 0.0), r.sel.assign(t.B * t.M * t.S, -1);
  const double ninf = -std::numeric_limits<double>::infinity();
  for (int64_t bi = 0; bi < t.B; ++bi)
    for (int64_t m = 0; m < t.M; ++m) {
      const int64_t unit = bi * t.M + m;
      auto score = [&](int64_t h, int64_t id) {
        double s = 0;
        for (int64_t d = 0; d < t.D; ++d) s += t.q[((bi * t.H + h) * t.M + m) * t.D + d] * t.k[((bi * t.H + h) * t.nodes + id) * t.D + d];
        return s * t.scale;
      };
      std::vector<int64_t> path(t.height + 1, 0);
      if (fixed) {
        const int64_t leaf = (*fixed)[unit * t.S + t.S - t.P];
        path[t.height] = t.group_offset + (leaf - t.leaf_offset) / t.P;
        for (int64_t l = t.height; l > 0; --l) path[l - 1] = (path[l] - 1) / t.b;
      }
      std::vector<int64_t> set;
      int64_t node = 0;
      for (int64_t level = 0; level < t.height; ++level) {
        const int64_t first = node * t.b + 1;
        std::vector<double> pi(t.b, 0.0);
        for (int64_t h = 0; h < t.H; ++h) {
          double mx = ninf, sum = 0;
          for (int64_t c = 0; c < t.b; ++c) if (!t.mask[bi * t.nodes + first + c]) mx = std::fmax(mx, score(h, first + c));
          if (mx == ninf) continue;
          for (int64_t c = 0; c < t.b; ++c) if (!t.mask[bi * t.nodes + first + c]) sum += std::exp(score(h, first + c) - mx);
          for (int64_t c = 0; c < t.b; ++c) if (!t.mask[bi * t.nodes + first + c]) pi[c] += std::exp(score(h, first + c) - mx) / sum / t.H;
        }
        int64_t choice = 0;
        if (fixed) {
          choice = path[level + 1] - first;
        } else if (t.u.empty()) {
          for (int64_t c = 1; c < t.b; ++c) if (pi[c] > pi[choice]) choice = c;
        } else {
          double total = 0, run = 0;
          for (double x : pi) total += x;
          const double thr = t.u[unit * t.height + level] * total;
          int64_t count = 0;
          for (int64_t c = 0; c < t.b; ++c) count += (run += pi[c]) <= thr;
          choice = count < t.b ? count : t.b - 1;
        }
        r.lp[unit] += std::log(pi[choice]);
        for (double x : pi) if (x > 0) r.ent[unit] -= x * std::log(x);
        for (int64_t c = 0; c < t.b; ++c) if (c != choice) set.push_back(first + c);
        node = first + choice;
      }
      const int64_t leaf0 = t.leaf_offset + (node - t.group_offset) * t.P;
      for (int64_t j = 0; j < t.P; ++j) set.push_back(leaf0 + j);
      for (int64_t j = 0; j < t.S; ++j) r.sel[unit * t.S + j] = set[j];
      for (int64_t h = 0; h < t.H; ++h) {
        const int64_t row = (bi * t.H + h) * t.M + m;
        double mx = ninf, sum = 0;
        for (int64_t id : set) if (!t.mask[bi * t.nodes + id]) mx = std::fmax(mx, score(h, id));
        if (mx == ninf) { r.lse[row] = ninf; continue; }
        for (int64_t id : set) if (!t.mask[bi * t.nodes + id]) sum += std::exp(score(h, id) - mx);
        r.lse[row] = mx + std::log(sum);
        for (int64_t id : set) {
          if (t.mask[bi * t.nodes + id]) continue;
          const double w = std::exp(score(h, id) - r.lse[row]);
          for (int64_t d = 0; d < t.Dv; ++d) r.out[row * t.Dv + d] += w * t.v[((bi * t.H + h) * t.nodes + id) * t.Dv + d];
        }
      }
    }
  return r;
}

int g_bad = 0;
void expect(const char* name, const char* what, int64_t i, double got, double want, double tol) {
  const bool ok = std::isinf(want) ? got == want : std::fabs(got - want) <= tol * (1 + std::fabs(want));
  if (!ok && ++g_bad <= 12) std::fprintf(stderr, "[%s] %s[%lld]: got %.8g want %.8g\n", name, what, (long long)i, got, want);
}

void run_case(const Case& c, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> normal;
  std::uniform_real_distribution<float> unif(0.0f, 1.0f);
  Tree t;
  t.B = c.B, t.H = c.H, t.M = c.M, t.D = c.D, t.Dv = c.Dv, t.b = c.b, t.height = c.height, t.P = c.P;
  t.group_offset = (ipow(c.b, c.height) - 1) / (c.b - 1);
  t.leaf_offset = (ipow(c.b, c.height + 1) - 1) / (c.b - 1);
  t.nodes = t.leaf_offset + c.P * ipow(c.b, c.height);
  t.S = c.height * (c.b - 1) + c.P;
  t.scale = 1.3 / std::sqrt(double(c.D));
  // Leaves: batch 0 padded at the tail (as build_tree pads), later batches at random; a node is
  // padding when all its children are.
  t.mask.assign(t.B * t.nodes, 0);
  const int64_t leaves = t.nodes - t.leaf_offset;
  std::bernoulli_distribution coin(0.35);
  for (int64_t bi = 0; bi < t.B; ++bi) {
    uint8_t* mk = t.mask.data() + bi * t.nodes;
    for (int64_t s = 0; s < leaves; ++s) mk[t.leaf_offset + s] = bi == 0 ? s >= leaves - (c.P + 1) : coin(gen);
    for (int64_t g = 0; g < t.leaf_offset - t.group_offset; ++g) {
      bool all = true;
      for (int64_t j = 0; j < c.P; ++j) all = all && mk[t.leaf_offset + g * c.P + j];
      mk[t.group_offset + g] = all;
    }
    for (int64_t id = t.group_offset - 1; id >= 0; --id) {
      bool all = true;
      for (int64_t j = 1; j <= c.b; ++j) all = all && mk[id * c.b + j];
      mk[id] = all;
    }
  }
  t.q.resize(t.B * t.H * t.M * t.D), t.k.resize(t.B * t.H * t.nodes * t.D), t.v.resize(t.B * t.H * t.nodes * t.Dv);
  for (double& x : t.q) x = double(float(normal(gen)));
  for (double& x : t.k) x = double(float(normal(gen)));
  for (double& x : t.v) x = double(float(normal(gen)));
  if (c.sample) {
    t.u.resize(t.B * t.M * t.height);
    for (float& x : t.u) x = unif(gen);
  }

  // Device-side copies: q as [B, M, H, D + 1]; k/v contiguous with NaN at padding nodes.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> q(t.B * t.M * t.H * (t.D + 1), nan), k(t.k.size()), v(t.v.size());
  TreeShapeParams s;
  s.B = t.B, s.H = t.H, s.M = t.M, s.D = t.D, s.Dv = t.Dv, s.nodes = t.nodes, s.branching = t.b, s.height = t.height;
  s.group_size = t.P, s.group_offset = t.group_offset, s.leaf_offset = t.leaf_offset, s.selected = t.S;
  s.q_stride_b = t.M * t.H * (t.D + 1), s.q_stride_h = t.D + 1, s.q_stride_m = t.H * (t.D + 1);
  s.k_stride_b = t.H * t.nodes * t.D, s.k_stride_h = t.nodes * t.D, s.k_stride_n = t.D;
  s.v_stride_b = t.H * t.nodes * t.Dv, s.v_stride_h = t.nodes * t.Dv, s.v_stride_n = t.Dv;
  s.mask_stride_b = t.nodes, s.scale = static_cast<float>(t.scale);
  for (int64_t bi = 0; bi < t.B; ++bi)
    for (int64_t h = 0; h < t.H; ++h) {
      for (int64_t m = 0; m < t.M; ++m)
        for (int64_t d = 0; d < t.D; ++d) q[bi * s.q_stride_b + h * s.q_stride_h + m * s.q_stride_m + d] = float(t.q[((bi * t.H + h) * t.M + m) * t.D + d]);
      for (int64_t n = 0; n < t.nodes; ++n) {
        const bool pad = t.mask[bi * t.nodes + n];
        for (int64_t d = 0; d < t.D; ++d) k[((bi * t.H + h) * t.nodes + n) * t.D + d] = pad ? nan : float(t.k[((bi * t.H + h) * t.nodes + n) * t.D + d]);
        for (int64_t d = 0; d < t.Dv; ++d) v[((bi * t.H + h) * t.nodes + n) * t.Dv + d] = pad ? nan : float(t.v[((bi * t.H + h) * t.nodes + n) * t.Dv + d]);
      }
    }
  TreeFwdParams p;
  p.s = s, p.q = q.data(), p.node_k = k.data(), p.node_v = v.data(), p.node_padding_mask = t.mask.data();
  p.uniforms = c.sample ? t.u.data() : nullptr;
  std::vector<float> out(t.B * t.H * t.M * t.Dv, 7.0f), lse(t.B * t.H * t.M, 7.0f), lp(t.B * t.M, 7.0f), ent(t.B * t.M, 7.0f);
  std::vector<int64_t> sel(t.B * t.M * t.S, -7);
  p.out = out.data(), p.lse = lse.data(), p.selected = sel.data(), p.log_prob = lp.data(), p.entropy = ent.data();
  const TreeLaunchPlan plan = plan_tree_cross_attention(t.B, t.M, t.H, t.D, t.Dv, t.b, t.P, t.height, false, kSm90);
  CHECK(plan.supported);
  CHECK(cuda_emu::run_grid(dim3(plan.grid.x), dim3(plan.block.x), det::smem_raw, sizeof(det::smem_raw),
                           plan.shared_memory_bytes, [&] { det::tree_cross_attention_fwd_kernel<float>(p); }));

  const Result want = reference(t, nullptr);
  for (size_t i = 0; i < sel.size(); ++i) expect(c.name, "selected", i, double(sel[i]), double(want.sel[i]), 0);
  for (size_t i = 0; i < out.size(); ++i) expect(c.name, "out", i, out[i], want.out[i], 2e-5);
  for (size_t i = 0; i < lse.size(); ++i) expect(c.name, "lse", i, lse[i], want.lse[i], 2e-5);
  for (size_t i = 0; i < lp.size(); ++i) expect(c.name, "log_prob", i, lp[i], want.lp[i], 2e-5);
  for (size_t i = 0; i < ent.size(); ++i) expect(c.name, "entropy", i, ent[i], want.ent[i], 2e-5);

  if (c.check_backward) {
    std::vector<float> go(out.size()), glse(lse.size()), glp(lp.size()), gent(ent.size());
    for (float& x : go) x = float(normal(gen));
    for (float& x : glse) x = float(normal(gen));
    for (float& x : glp) x = float(normal(gen));
    for (float& x : gent) x = float(normal(gen));
    TreeBwdParams g;
    g.s = s, g.grad_out = go.data(), g.grad_lse = glse.data(), g.grad_log_prob = glp.data(), g.grad_entropy = gent.data();
    g.q = q.data(), g.node_k = k.data(), g.node_v = v.data(), g.node_padding_mask = t.mask.data();
    g.selected = sel.data(), g.lse = lse.data();
    std::vector<float> dq(t.B * t.H * t.M * t.D, nan), dk(t.k.size(), 0.0f), dv(t.v.size(), 0.0f);
    g.grad_q = dq.data(), g.grad_node_k = dk.data(), g.grad_node_v = dv.data();
    const TreeLaunchPlan bplan = plan_tree_cross_attention(t.B, t.M, t.H, t.D, t.Dv, t.b, t.P, t.height, true, kSm90);
    CHECK(bplan.supported);
    CHECK(cuda_emu::run_grid(dim3(bplan.grid.x), dim3(bplan.block.x), det::smem_raw, sizeof(det::smem_raw),
                             bplan.shared_memory_bytes, [&] { det::tree_cross_attention_bwd_kernel<float>(g); }));
    auto loss = [&](const Tree& tt) {
      const Result r = reference(tt, &sel);
      double l = 0;
      for (size_t i = 0; i < r.out.size(); ++i) l += r.out[i] * go[i];
      for (size_t i = 0; i < r.lse.size(); ++i) if (std::isfinite(r.lse[i])) l += r.lse[i] * glse[i];
      for (size_t i = 0; i < r.lp.size(); ++i) l += r.lp[i] * glp[i] + r.ent[i] * gent[i];
      return l;
    };
    auto fd = [&](std::vector<double> Tree::*field, size_t i) {
      Tree tt = t;
      const double eps = 1e-6;
      (tt.*field)[i] += eps;
      const double up = loss(tt);
      (tt.*field)[i] -= 2 * eps;
      return (up - loss(tt)) / (2 * eps);
    };
    for (size_t i = 0; i < dq.size(); ++i) expect(c.name, "grad_q", i, dq[i], fd(&Tree::q, i), 2e-4);
    for (size_t i = 0; i < dk.size(); ++i) {
      const int64_t n = (i / t.D) % t.nodes, bi = i / (t.D * t.nodes * t.H);
      expect(c.name, "grad_k", i, dk[i], t.mask[bi * t.nodes + n] ? 0.0 : fd(&Tree::k, i), 2e-4);
    }
    for (size_t i = 0; i < dv.size(); ++i) {
      const int64_t n = (i / t.Dv) % t.nodes, bi = i / (t.Dv * t.nodes * t.H);
      expect(c.name, "grad_v", i, dv[i], t.mask[bi * t.nodes + n] ? 0.0 : fd(&Tree::v, i), 2e-4);
    }
  }
  std::printf("  %-44s S=%lld warps=%d smem=%zu B ok=%s\n", c.name, (long long)t.S, plan.warps,
              plan.shared_memory_bytes, g_bad ? "NO" : "yes");
  CHECK(g_bad == 0);
  g_bad = 0;
}

/// The NaN rule (docs/tree.md): on a clean run and a poisoned copy of the same inputs, exactly the
/// expected outputs turn NaN and every other one is bitwise unchanged. Batch 0: a NaN key of a root
/// child (every query's first step); batch 1: a NaN q row of query 2 in head 0; batch 2: a NaN value
/// element (head 1, column 1) of the first leaf query 0 reads, and +inf keys at padding leaves.
void nan_case() {
  const int64_t B = 3, H = 2, M = 4, D = 4, Dv = 3, b = 2, height = 2, P = 2;
  const int64_t group_offset = 3, leaf_offset = 7, nodes = leaf_offset + P * 4, S = height + P;
  std::mt19937 gen(9);
  std::normal_distribution<float> normal;
  std::vector<float> q(B * H * M * D), k(B * H * nodes * D), v(B * H * nodes * Dv);
  for (float& x : q) x = normal(gen);
  for (float& x : k) x = normal(gen);
  for (float& x : v) x = normal(gen);
  std::vector<uint8_t> mask(B * nodes, 0);
  mask[2 * nodes + nodes - 1] = mask[2 * nodes + nodes - 3] = 1;  // batch 2: the 2nd leaves of groups 5 and 6 padded
  TreeShapeParams s;
  s.B = B, s.H = H, s.M = M, s.D = D, s.Dv = Dv, s.nodes = nodes, s.branching = b, s.height = height;
  s.group_size = P, s.group_offset = group_offset, s.leaf_offset = leaf_offset, s.selected = S;
  s.q_stride_b = H * M * D, s.q_stride_h = M * D, s.q_stride_m = D;
  s.k_stride_b = H * nodes * D, s.k_stride_h = nodes * D, s.k_stride_n = D;
  s.v_stride_b = H * nodes * Dv, s.v_stride_h = nodes * Dv, s.v_stride_n = Dv;
  s.mask_stride_b = nodes, s.scale = 0.5f;
  struct Run { std::vector<float> out, lse, lp, ent; std::vector<int64_t> sel; };
  auto run = [&](const std::vector<float>& qq, const std::vector<float>& kk, const std::vector<float>& vv) {
    Run r{std::vector<float>(B * H * M * Dv), std::vector<float>(B * H * M), std::vector<float>(B * M),
          std::vector<float>(B * M), std::vector<int64_t>(B * M * S)};
    TreeFwdParams p;
    p.s = s, p.q = qq.data(), p.node_k = kk.data(), p.node_v = vv.data(), p.node_padding_mask = mask.data();
    p.out = r.out.data(), p.lse = r.lse.data(), p.selected = r.sel.data(), p.log_prob = r.lp.data();
    p.entropy = r.ent.data();
    const TreeLaunchPlan plan = plan_tree_cross_attention(B, M, H, D, Dv, b, P, height, false, kSm90);
    CHECK(cuda_emu::run_grid(dim3(plan.grid.x), dim3(plan.block.x), det::smem_raw, sizeof(det::smem_raw),
                             plan.shared_memory_bytes, [&] { det::tree_cross_attention_fwd_kernel<float>(p); }));
    return r;
  };
  const Run clean = run(q, k, v);
  std::vector<float> qn = q, kn = k, vn = v;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  kn[(0 * H + 1) * nodes * D + 2 * D + 3] = nan;                     // batch 0, head 1, node 2 (root child)
  qn[((1 * H + 0) * M + 2) * D + 1] = nan;                           // batch 1, head 0, query 2
  const int64_t leaf = clean.sel[(2 * M + 0) * S + S - P];           // batch 2, query 0's first leaf
  vn[((2 * H + 1) * nodes + leaf) * Dv + 1] = nan;
  for (int64_t d = 0; d < D; ++d) kn[(2 * H + 0) * nodes * D + (nodes - 1) * D + d] = inf;  // padding leaf
  const Run got = run(qn, kn, vn);
  for (int64_t bi = 0; bi < B; ++bi)
    for (int64_t m = 0; m < M; ++m) {
      const bool query_nan = bi == 0 || (bi == 1 && m == 2);
      bool reads_leaf = false;
      for (int64_t j = 0; j < S; ++j) reads_leaf = reads_leaf || (bi == 2 && clean.sel[(bi * M + m) * S + j] == leaf);
      CHECK(std::isnan(got.lp[bi * M + m]) == query_nan && std::isnan(got.ent[bi * M + m]) == query_nan);
      if (!query_nan) CHECK(got.lp[bi * M + m] == clean.lp[bi * M + m] && got.ent[bi * M + m] == clean.ent[bi * M + m]);
      for (int64_t h = 0; h < H; ++h) {
        const int64_t row = (bi * H + h) * M + m;
        CHECK(std::isnan(got.lse[row]) == query_nan);
        if (!query_nan) CHECK(got.lse[row] == clean.lse[row]);
        for (int64_t d = 0; d < Dv; ++d) {
          const bool want = query_nan || (reads_leaf && h == 1 && d == 1);
          const float x = got.out[row * Dv + d];
          CHECK(std::isnan(x) == want);
          if (!want) CHECK(x == clean.out[row * Dv + d]);
        }
      }
    }
  // Batch 0 took the first valid child at its NaN step, so its paths are still well-formed.
  for (int64_t m = 0; m < M; ++m) CHECK(got.sel[m * S] == 2);
  std::printf("  %-44s ok=%s\n", "NaN rule (key, q row, value, padding)", attn_ext_tests::g_failures ? "NO" : "yes");
}

void plan_cases() {
  const TreeLaunchPlan a = plan_tree_cross_attention(2, 5, 4, 64, 64, 2, 8, 6, false, kSm90);
  CHECK(a.supported && a.warps == 4 && a.grid.x == 3 && a.block.x == 128 && a.shared_memory_bytes == 4 * a.warp_bytes);
  CHECK(a.warp_bytes % 16 == 0);
  const TreeLaunchPlan wide = plan_tree_cross_attention(1, 10, 16, 256, 256, 2, 8, 6, true, kSm90);
  CHECK(wide.supported && wide.warps == 1 && wide.shared_memory_bytes > kDefaultDynamicSmemBytes);
  // One query per warp is the smallest tile: a state over the device's limit is refused with the
  // bytes it needs (H = 21, D = Dv = 384: 99760 bytes per warp; fits sm_86's 99 KiB, not sm_70's 96).
  const TreeLaunchPlan sm86 = plan_tree_cross_attention(1, 1, 21, 384, 384, 2, 8, 6, true, 101376);
  CHECK(sm86.supported && sm86.warps == 1 && sm86.shared_memory_bytes == 99760);
  const TreeLaunchPlan sm70 = plan_tree_cross_attention(1, 1, 21, 384, 384, 2, 8, 6, true, 98304);
  CHECK(!sm70.supported && sm70.smem.kernel != nullptr && sm70.smem.needed_bytes == 99760 &&
        sm70.smem.limit_bytes == 98304);
  CHECK(plan_tree_cross_attention(1, 1, 64, 256, 256, 2, 8, 6, true, kSm90).supported);    // 197 KiB per warp
  CHECK(!plan_tree_cross_attention(1, 1, 80, 256, 256, 2, 8, 6, true, kSm90).supported);  // > 227 KiB per warp
  CHECK(plan_tree_cross_attention(0, 3, 1, 8, 8, 2, 1, 1, false, kSm90).empty);
  CHECK(!plan_tree_cross_attention(1, 1, 1, 8, 8, 1, 1, 1, false, kSm90).supported);  // branching 1
}

}  // namespace

int main() {
  plan_cases();
  // name, B, H, M, D, Dv, b, height, P, sample, check_backward
  run_case({"greedy b=2 h=3 P=3 D=40 Dv=59 M=7", 2, 3, 7, 40, 59, 2, 3, 3, false, false}, 1);
  run_case({"sampled b=3 h=2 P=4 D=33 Dv=8", 3, 2, 6, 33, 8, 3, 2, 4, true, false}, 2);
  run_case({"height 0 (one group) P=5", 2, 2, 3, 16, 16, 2, 0, 5, false, false}, 3);
  run_case({"backward greedy b=2 h=2 P=2 D=5 Dv=3", 2, 2, 5, 5, 3, 2, 2, 2, false, true}, 4);
  run_case({"backward sampled b=3 h=2 P=3 D=6 Dv=4", 2, 2, 3, 6, 4, 3, 2, 3, true, true}, 5);
  nan_case();
  if (attn_ext_tests::g_failures != 0) {
    std::fprintf(stderr, "attn_ext_cuda_tree_emulation_tests: %d failure(s)\n", attn_ext_tests::g_failures);
    return 1;
  }
  std::printf("attn_ext_cuda_tree_emulation_tests: all cases passed\n");
  return 0;
}
