// Runs the CUDA state-merge kernel's source on the host (cuda_emulation/) against a double reference
// of docs/spec.md §1's merge, including the identity state (0, −inf) on either or both sides, and checks
// plan_merge_states() (grid-stride cap, Dv = 0, rejected inputs).
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "cuda_emulation/emulator_extras_tree.h"
#include "merge_states_kernel.cuh"

namespace {

using attn_ext::cuda::MergeStatesParams;
using attn_ext::cuda::MergeStatesPlan;
using attn_ext::ScalarType;
using attn_ext::cuda::detail::from_float;
using attn_ext::cuda::detail::to_float;

int g_failures = 0;

void check(bool cond, const char* what, long long index = 0, double got = 0, double want = 0) {
  if (!cond && ++g_failures <= 20) std::fprintf(stderr, "%s at %lld: got %.9g want %.9g\n", what, index, got, want);
}

template <typename scalar_t>
void run_case(const char* name, int64_t rows, int64_t Dv, ScalarType dtype, double tol, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<scalar_t> a(rows * Dv), b(rows * Dv), out(rows * Dv + 1, from_float<scalar_t>(12288.0f));
  std::vector<float> la(rows), lb(rows), lse(rows + 1, 12288.0f);
  for (int64_t i = 0; i < rows * Dv; ++i) a[i] = from_float<scalar_t>(normal(gen)), b[i] = from_float<scalar_t>(normal(gen));
  for (int64_t r = 0; r < rows; ++r) {
    la[r] = r % 5 == 1 || r % 7 == 3 ? -inf : normal(gen);  // identity states on side a, b or both
    lb[r] = r % 3 == 2 || r % 7 == 3 ? -inf : normal(gen) + (r % 4 == 0 ? 60.0f : 0.0f);
  }
  MergeStatesParams p;
  p.out_a = a.data(), p.out_b = b.data(), p.lse_a = la.data(), p.lse_b = lb.data(), p.out = out.data();
  p.lse = lse.data(), p.rows = rows, p.Dv = Dv, p.dtype = dtype;
  const MergeStatesPlan plan = attn_ext::cuda::plan_merge_states(rows, Dv, dtype);
  check(plan.supported, "plan rejected the case");
  cuda_emu::run_grid(dim3(plan.grid.x), dim3(plan.block.x), attn_ext::cuda::detail::smem_raw, 0, 0,
                     [&] { attn_ext::cuda::detail::merge_states_fwd_kernel<scalar_t>(p); });
  check(lse[rows] == 12288.0f && to_float(out[rows * Dv]) == 12288.0f, "write past the end");
  const int before = g_failures;
  for (int64_t r = 0; r < rows; ++r) {
    const double x = la[r], y = lb[r];
    const double want = std::isinf(x) && std::isinf(y) ? -HUGE_VAL : std::max(x, y) + std::log1p(std::exp(-std::fabs(x - y)));
    check(std::isinf(want) ? lse[r] == want : std::fabs(lse[r] - want) <= 1e-5 * (1 + std::fabs(want)), "lse", r,
          lse[r], want);
    const double wa = std::isinf(want) ? 0 : std::exp(x - want), wb = std::isinf(want) ? 0 : std::exp(y - want);
    for (int64_t d = 0; d < Dv; ++d) {
      const double o = wa * to_float(a[r * Dv + d]) + wb * to_float(b[r * Dv + d]);
      const double got = to_float(out[r * Dv + d]);
      check(std::fabs(got - o) <= tol * (1 + std::fabs(o)), "out", r * Dv + d, got, o);
    }
  }
  std::printf("  %-28s grid=%u ok=%s\n", name, plan.grid.x, g_failures == before ? "yes" : "NO");
}

}  // namespace

int main() {
  run_case<float>("fp32 rows=37 Dv=59", 37, 59, ScalarType::kFloat32, 1e-6, 1);
  run_case<__half>("fp16 rows=100 Dv=8", 100, 8, ScalarType::kFloat16, 1e-3, 2);
  run_case<__nv_bfloat16>("bf16 rows=21 Dv=33", 21, 33, ScalarType::kBFloat16, 8e-3, 3);
  run_case<float>("fp32 Dv=0 (lse only)", 9, 0, ScalarType::kFloat32, 1e-6, 4);
  const MergeStatesPlan huge = attn_ext::cuda::plan_merge_states(int64_t(1) << 30, 64, ScalarType::kFloat16);
  check(huge.supported && huge.grid.x == attn_ext::cuda::kMergeStatesMaxBlocks, "grid-stride cap");
  check(attn_ext::cuda::plan_merge_states(0, 64, ScalarType::kFloat32).grid.x == 0, "empty: no launch");
  check(!attn_ext::cuda::plan_merge_states(-1, 64, ScalarType::kFloat32).supported, "negative rows rejected");
  check(!attn_ext::cuda::plan_merge_states(4, 4, static_cast<ScalarType>(5)).supported, "bad dtype rejected");
  if (g_failures != 0) {
    std::fprintf(stderr, "attn_ext_cuda_merge_states_emulation_tests: %d failure(s)\n", g_failures);
    return 1;
  }
  std::printf("attn_ext_cuda_merge_states_emulation_tests: all cases passed\n");
  return 0;
}
