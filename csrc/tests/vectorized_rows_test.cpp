// Host tests of the score-row loops of the CPU attention kernels (cpu/vectorized_rows.h): every
// instruction-set copy this CPU runs against double precision, at every tail length. Torch-free.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "cpu/vectorized_rows.h"
#include "tests/check.h"

namespace {

using attn_ext::cpu::IsaLevel;
using attn_ext::cpu::RowKernels;
using attn_ext_tests::g_failures;

constexpr float kInf = std::numeric_limits<float>::infinity();

/// Scores with the values that matter: ordinary ones, −inf (padded keys), the maximum itself
/// (exp = 1), and arguments at and below log(FLT_MIN), where exp must flush to exactly 0.
std::vector<float> scores(int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-30.0f, 5.0f);
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) {
    switch (rng() % 8) {
      case 0: x[i] = -kInf; break;
      case 1: x[i] = -90.0f; break;  // below log(FLT_MIN) after the shift
      default: x[i] = uniform(rng);
    }
  }
  return x;
}

void check_level(IsaLevel level) {
  const RowKernels& k = attn_ext::cpu::row_kernels(level);
  std::mt19937 rng(7);
  // Lengths 0..70 cover empty rows, tails shorter than a vector and every remainder of 4, 8 and 16 lanes.
  for (int64_t n = 0; n <= 70; ++n) {
    std::vector<float> x = scores(n, rng);
    double expect_max = -INFINITY;
    for (float v : x) expect_max = std::fmax(expect_max, static_cast<double>(v));
    const float got_max = k.row_max(x.data(), n);
    CHECK(static_cast<double>(got_max) == expect_max);

    const float shift = n > 0 && std::isfinite(got_max) ? got_max : 0.0f;
    std::vector<double> expect(n);
    double expect_sum = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const double arg = static_cast<double>(x[i]) - static_cast<double>(shift);
      expect[i] = arg < std::log(static_cast<double>(std::numeric_limits<float>::min())) ? 0.0 : std::exp(arg);
      expect_sum += expect[i];
    }
    std::vector<float> e = x;
    const float sum = k.exp_shifted_inplace_sum(e.data(), n, shift);
    for (int64_t i = 0; i < n; ++i) {
      // Padded keys must not leak: exactly 0. Otherwise ~2 ulp of the polynomial plus the rounding
      // of x − shift (half an ulp of the argument, which the exponential turns into a relative error).
      const double tol =
          expect[i] == 0.0 ? 0.0 : expect[i] * (3e-7 + 6e-8 * std::fabs(static_cast<double>(x[i]) - shift));
      if (!(std::fabs(e[i] - expect[i]) <= tol)) {
        ++g_failures;
        std::fprintf(stderr, "%s n=%lld i=%lld: exp(%g - %g) = %.9g, expected %.9g\n",
                     attn_ext::cpu::isa_name(level), static_cast<long long>(n), static_cast<long long>(i),
                     x[i], shift, e[i], expect[i]);
      }
    }
    CHECK(std::fabs(sum - expect_sum) <= 1e-5 * (1.0 + expect_sum));

    std::vector<float> p(n), dp(n), ds(n);
    for (int64_t i = 0; i < n; ++i) {
      p[i] = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
      dp[i] = std::uniform_real_distribution<float>(-3.0f, 3.0f)(rng);
    }
    k.score_gradient_row(p.data(), dp.data(), ds.data(), n, 0.25f);
    for (int64_t i = 0; i < n; ++i) {
      const double want = static_cast<double>(p[i]) * (static_cast<double>(dp[i]) - 0.25);
      CHECK(std::fabs(ds[i] - want) <= 2e-7 * (1.0 + std::fabs(want)));
    }
    k.score_gradient_row(p.data(), dp.data(), dp.data(), n, 0.25f);  // in place, as the backward calls it
    for (int64_t i = 0; i < n; ++i) CHECK(dp[i] == ds[i]);
  }
  // A NaN score, in the body or in any part of the tail: the maximum ignores it, the sum is NaN.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t n = 1; n <= 40; ++n) {
    for (int64_t at = 0; at < n; ++at) {
      std::vector<float> x(n);
      for (int64_t i = 0; i < n; ++i) x[i] = -static_cast<float>((i * 7) % 11);
      x[at] = nan;
      float expect_max = -kInf;
      for (int64_t i = 0; i < n; ++i) expect_max = x[i] > expect_max ? x[i] : expect_max;
      CHECK(k.row_max(x.data(), n) == expect_max);
      CHECK(std::isnan(k.exp_shifted_inplace_sum(x.data(), n, 0.0f)));
      CHECK(std::isnan(x[at]));
    }
  }
}

}  // namespace

int main() {
  const IsaLevel cpu = attn_ext::cpu::cpu_isa_level();
  for (IsaLevel level : {IsaLevel::kBaseline, IsaLevel::kAvx2, IsaLevel::kAvx512}) {
    if (level > cpu) {
      std::printf("attn_ext_vectorized_rows_tests: %s not run (this CPU lacks it)\n", attn_ext::cpu::isa_name(level));
      continue;
    }
    check_level(level);
    std::printf("attn_ext_vectorized_rows_tests: %s checked\n", attn_ext::cpu::isa_name(level));
  }
  if (g_failures != 0) {
    std::fprintf(stderr, "attn_ext_vectorized_rows_tests: %d check(s) failed\n", g_failures);
    return g_failures > 100 ? 100 : g_failures;
  }
  std::printf("attn_ext_vectorized_rows_tests: all checks passed\n");
  return 0;
}
