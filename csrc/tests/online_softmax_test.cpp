// Host tests of attn_ext/online_softmax.h and cuda/attention_fwd_plan.h: plain C++17, no torch, no GPU.
// Exit status = number of failed checks (capped), so ctest reports any failure.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "attn_ext/online_softmax.h"
#include "cuda/attention_fwd_plan.h"

#include "tests/check.h"

namespace {

using attn_ext_tests::g_failures;

#define CHECK_NEAR(a, b, tol)                                                                  \
  do {                                                                                         \
    const double va_ = (a), vb_ = (b);                                                         \
    if (!(std::fabs(va_ - vb_) <= (tol) * (1.0 + std::fabs(vb_)))) {                           \
      ++g_failures;                                                                            \
      std::fprintf(stderr, "%s:%d: CHECK_NEAR failed: %s = %.9g vs %s = %.9g\n", __FILE__,     \
                   __LINE__, #a, va_, #b, vb_);                                                \
    }                                                                                          \
  } while (0)

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

/// Normalised state (o, lse) of one query row over a key set.
struct State {
  std::vector<double> o;
  double lse;
};

/// Direct two-pass computation in double: the ground truth.
State direct(const std::vector<double>& s, const std::vector<std::vector<double>>& v, size_t dv) {
  double m = kNegInf;
  for (double x : s) m = std::max(m, x);
  State st{std::vector<double>(dv, 0.0), kNegInf};
  if (m == kNegInf) return st;
  double sum = 0;
  for (double x : s) sum += std::exp(x - m);
  st.lse = m + std::log(sum);
  for (size_t i = 0; i < s.size(); ++i) {
    const double p = std::exp(s[i] - st.lse);
    for (size_t c = 0; c < dv; ++c) st.o[c] += p * v[i][c];
  }
  return st;
}

/// The streaming loop every kernel runs, over blocks of `block` keys, in precision acc_t.
template <typename acc_t>
State streamed(const std::vector<double>& s, const std::vector<std::vector<double>>& v, size_t dv, size_t block) {
  using namespace attn_ext;
  OnlineSoftmaxRow<acc_t> row = online_softmax_empty<acc_t>();
  std::vector<acc_t> acc(dv, acc_t(0));
  for (size_t b0 = 0; b0 < s.size(); b0 += block) {
    const size_t b1 = std::min(s.size(), b0 + block);
    acc_t bmax = negative_infinity<acc_t>();
    for (size_t i = b0; i < b1; ++i) bmax = std::max(bmax, static_cast<acc_t>(s[i]));
    const acc_t factor = online_softmax_advance(row, bmax);
    for (auto& a : acc) a *= factor;
    const acc_t shift = online_softmax_shift(row);
    for (size_t i = b0; i < b1; ++i) {
      const acc_t p = math_exp(static_cast<acc_t>(s[i]) - shift);
      row.sum += p;
      for (size_t c = 0; c < dv; ++c) acc[c] += p * static_cast<acc_t>(v[i][c]);
    }
  }
  const OnlineSoftmaxResult<acc_t> res = online_softmax_finish(row);
  State st{std::vector<double>(dv), static_cast<double>(res.lse)};
  for (size_t c = 0; c < dv; ++c) st.o[c] = static_cast<double>(acc[c] * res.inv_sum);
  return st;
}

State merge(const State& a, const State& b) {
  const auto w = attn_ext::state_merge_weights(a.lse, b.lse);
  State st{std::vector<double>(a.o.size()), w.lse};
  for (size_t c = 0; c < a.o.size(); ++c) st.o[c] = w.weight_a * a.o[c] + w.weight_b * b.o[c];
  return st;
}

void check_state(const State& got, const State& want, double tol) {
  if (want.lse == kNegInf) {
    CHECK(got.lse == kNegInf);
  } else {
    CHECK_NEAR(got.lse, want.lse, tol);
  }
  for (size_t c = 0; c < want.o.size(); ++c) {
    CHECK(!std::isnan(got.o[c]));
    CHECK_NEAR(got.o[c], want.o[c], tol);
  }
}

void test_streaming_matches_direct() {
  std::mt19937 gen(1234);
  std::normal_distribution<double> normal(0.0, 3.0);
  std::bernoulli_distribution masked(0.3);
  const size_t dv = 5;
  for (size_t n : {1u, 7u, 32u, 100u, 257u}) {
    std::vector<double> s(n);
    std::vector<std::vector<double>> v(n, std::vector<double>(dv));
    for (size_t i = 0; i < n; ++i) {
      s[i] = masked(gen) ? kNegInf : normal(gen);  // masked keys arrive as −inf scores
      for (auto& x : v[i]) x = normal(gen);
    }
    // Leading fully-masked blocks exercise the "empty row so far" branch of advance/shift.
    for (size_t i = 0; i < std::min<size_t>(n / 2, 40); ++i) s[i] = kNegInf;
    const State want = direct(s, v, dv);
    for (size_t block : {1u, 3u, 16u, 32u, 1000u}) {
      check_state(streamed<double>(s, v, dv, block), want, 1e-12);
      check_state(streamed<float>(s, v, dv, block), want, 2e-5);
    }
  }
}

void test_large_scores_do_not_overflow() {
  const std::vector<double> s = {1e4, 1e4 - 1.0, -1e4, 5e3};
  const std::vector<std::vector<double>> v = {{1.0}, {2.0}, {3.0}, {4.0}};
  const State want = direct(s, v, 1);
  check_state(streamed<float>(s, v, 1, 1), want, 1e-6);
  check_state(streamed<double>(s, v, 1, 2), want, 1e-12);
}

void test_empty_rows() {
  using namespace attn_ext;
  // No block at all.
  const auto none = online_softmax_finish(online_softmax_empty<float>());
  CHECK(is_negative_infinity(none.lse));
  CHECK(none.inv_sum == 0.0f);
  // Only masked blocks: the accumulator factor stays finite and the shift is 0, so exp(−inf) = 0.
  OnlineSoftmaxRow<float> row = online_softmax_empty<float>();
  for (int i = 0; i < 3; ++i) {
    const float factor = online_softmax_advance(row, negative_infinity<float>());
    CHECK(factor == 1.0f);
    CHECK(online_softmax_shift(row) == 0.0f);
    CHECK(math_exp(negative_infinity<float>() - online_softmax_shift(row)) == 0.0f);
  }
  const auto res = online_softmax_finish(row);
  CHECK(is_negative_infinity(res.lse));
  CHECK(res.inv_sum == 0.0f);
  CHECK(0.0f * res.inv_sum == 0.0f);  // out = acc · inv_sum = 0, not NaN
  // And the state machinery streams such a row to (0, −inf).
  const std::vector<double> s(10, kNegInf);
  const std::vector<std::vector<double>> v(10, std::vector<double>(2, 1.0));
  check_state(streamed<float>(s, v, 2, 4), State{{0.0, 0.0}, kNegInf}, 0.0);
  CHECK(softmax_probability(3.0f, negative_infinity<float>()) == 0.0f);
  CHECK_NEAR(softmax_probability(1.0, 1.0), 1.0, 1e-15);
  CHECK_NEAR(score_gradient(0.5, 2.0, 1.0, 0.25), 0.5 * (2.0 - 1.0 + 0.25), 1e-15);
}

void test_nan_never_reads_as_empty() {
  using namespace attn_ext;
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = -kNegInf;
  const std::vector<std::vector<double>> v(6, std::vector<double>(2, 1.0));
  // A NaN score (dropped by the block max, kept by the sum) or +inf (inf − inf) anywhere — in a
  // leading block of masked keys too — makes out and lse NaN, however the keys are blocked.
  for (size_t at : {0u, 2u, 5u}) {
    for (double bad : {nan, inf}) {
      std::vector<double> s = {kNegInf, kNegInf, 0.5, -1.0, 2.0, 0.25};
      s[at] = bad;
      for (size_t block : {1u, 2u, 4u, 6u}) {
        const State got = streamed<float>(s, v, 2, block);
        CHECK(std::isnan(got.lse) && std::isnan(got.o[0]) && std::isnan(got.o[1]));
      }
    }
  }
  const OnlineSoftmaxRow<float> nan_row{1.0f, std::numeric_limits<float>::quiet_NaN()};
  const auto finished = online_softmax_finish(nan_row);
  CHECK(std::isnan(finished.lse) && std::isnan(finished.inv_sum));
  CHECK(std::isnan(quiet_nan<float>()) && std::isnan(quiet_nan<double>()));
  CHECK(std::isnan(softmax_probability(1.0f, quiet_nan<float>())));  // a NaN row's backward is NaN
  // A NaN lse on either side poisons the merge, the empty side included.
  for (double other : {kNegInf, -1e30, -3.0, 0.0, 700.0, nan}) {
    for (const auto& w : {state_merge_weights(nan, other), state_merge_weights(other, nan)}) {
      CHECK(std::isnan(w.lse) && std::isnan(w.weight_a) && std::isnan(w.weight_b));
    }
  }
  // NaN in out: kept by a zero weight too (0 · NaN), while the lse and the other entries are exact.
  const State with_nan{{nan, 1.0}, 0.5}, empty{{0.0, 0.0}, kNegInf};
  const State a = merge(empty, with_nan);
  CHECK(std::isnan(a.o[0]) && a.o[1] == 1.0 && a.lse == 0.5);
  const State b = merge(State{{nan, 0.0}, kNegInf}, State{{2.0, 3.0}, 1.0});
  CHECK(std::isnan(b.o[0]) && b.o[1] == 3.0 && b.lse == 1.0);
}

void test_merge_weights() {
  using attn_ext::state_merge_weights;
  const double values[] = {kNegInf, -1e30, -3.5, 0.0, 0.0, 2.25, 700.0};
  for (double a : values) {
    for (double b : values) {
      const auto ab = state_merge_weights(a, b);
      const auto ba = state_merge_weights(b, a);
      CHECK(!std::isnan(ab.lse) && !std::isnan(ab.weight_a) && !std::isnan(ab.weight_b));
      CHECK(ab.lse == ba.lse);  // commutative, bit for bit
      CHECK(ab.weight_a == ba.weight_b);
      CHECK(ab.weight_b == ba.weight_a);
      if (a == kNegInf && b == kNegInf) {
        CHECK(ab.lse == kNegInf && ab.weight_a == 0.0 && ab.weight_b == 0.0);
      } else {
        const double m = std::max(a, b);
        CHECK_NEAR(ab.lse, m + std::log(std::exp(a - m) + std::exp(b - m)), 1e-14);
        CHECK_NEAR(ab.weight_a + ab.weight_b, 1.0, 1e-15);
      }
    }
  }
  // The identity (0, −inf) leaves the other side untouched.
  const auto id = state_merge_weights(1.5, kNegInf);
  CHECK(id.lse == 1.5 && id.weight_a == 1.0 && id.weight_b == 0.0);
  const auto half = state_merge_weights(2.0, 2.0);
  CHECK_NEAR(half.lse, 2.0 + std::log(2.0), 1e-15);
  CHECK(half.weight_a == 0.5 && half.weight_b == 0.5);
  const auto fl = state_merge_weights(attn_ext::negative_infinity<float>(), attn_ext::negative_infinity<float>());
  CHECK(attn_ext::is_negative_infinity(fl.lse) && fl.weight_a == 0.0f && fl.weight_b == 0.0f);
}

void test_merge_of_splits_equals_whole() {
  std::mt19937 gen(99);
  std::normal_distribution<double> normal(0.0, 2.0);
  const size_t n = 60, dv = 4;
  std::vector<double> s(n);
  std::vector<std::vector<double>> v(n, std::vector<double>(dv));
  for (size_t i = 0; i < n; ++i) {
    s[i] = normal(gen);
    for (auto& x : v[i]) x = normal(gen);
  }
  s[3] = kNegInf;
  const State whole = direct(s, v, dv);
  for (size_t cut : {0u, 1u, 17u, 59u, 60u}) {  // cuts at the ends give an empty side
    const std::vector<double> sa(s.begin(), s.begin() + cut), sb(s.begin() + cut, s.end());
    const std::vector<std::vector<double>> va(v.begin(), v.begin() + cut), vb(v.begin() + cut, v.end());
    const State a = streamed<double>(sa, va, dv, 8), b = streamed<double>(sb, vb, dv, 8);
    check_state(merge(a, b), whole, 1e-12);
    check_state(merge(b, a), whole, 1e-12);
  }
  // Associativity over three parts.
  const auto part = [&](size_t lo, size_t hi) {
    return direct(std::vector<double>(s.begin() + lo, s.begin() + hi),
                  std::vector<std::vector<double>>(v.begin() + lo, v.begin() + hi), dv);
  };
  const State p1 = part(0, 10), p2 = part(10, 35), p3 = part(35, 60);
  check_state(merge(merge(p1, p2), p3), whole, 1e-12);
  check_state(merge(p1, merge(p2, p3)), whole, 1e-12);
}

void test_launch_plan() {
  using namespace attn_ext::cuda;
  using attn_ext::ScalarType;
  constexpr std::size_t kSm90 = 232448;  // sm_90's opt-in shared memory per block (and 90 its capability)
  const ScalarType dtypes[] = {ScalarType::kFloat32, ScalarType::kFloat16, ScalarType::kBFloat16};
  CHECK(cross_attention_fwd_head_dim_instantiation(1) == 32);
  CHECK(cross_attention_fwd_head_dim_instantiation(32) == 32);
  CHECK(cross_attention_fwd_head_dim_instantiation(40) == 64);
  CHECK(cross_attention_fwd_head_dim_instantiation(59) == 64);
  CHECK(cross_attention_fwd_head_dim_instantiation(96) == 128);
  CHECK(cross_attention_fwd_head_dim_instantiation(256) == 256);
  CHECK(cross_attention_fwd_head_dim_instantiation(257) == 0);
  CHECK(cross_attention_fwd_head_dim_instantiation(0) == 0);

  const int64_t shapes[][6] = {{2, 4, 128, 1000, 64, 64}, {1, 1, 1, 1, 40, 59},     {3, 2, 37, 0, 96, 300 - 44},
                               {16, 8, 4096, 77, 128, 32}, {1, 12, 100, 513, 256, 256}, {2, 3, 33, 5, 1, 1}};
  for (const auto& sh : shapes) {
    for (ScalarType dt : dtypes) {
      const CrossAttentionLaunchPlan p =
          plan_cross_attention_fwd(sh[0], sh[1], sh[2], sh[3], sh[4], sh[5], dt, kSm90, 90);
      CHECK(p.supported && p.error == nullptr && !p.empty);
      CHECK(p.tensor_cores == (dt != ScalarType::kFloat32));
      const int64_t wide = sh[4] > sh[5] ? sh[4] : sh[5];  // the tensor-core kernel's one dimension
      const int64_t d_bound = p.tensor_cores ? wide : sh[4], dv_bound = p.tensor_cores ? wide : sh[5];
      CHECK(p.head_dim_instantiation >= sh[4] && p.head_dim_instantiation < 2 * d_bound + 32);
      CHECK(p.head_dim_v_instantiation >= sh[5] && p.head_dim_v_instantiation < 2 * dv_bound + 32);
      CHECK(!p.tensor_cores || p.head_dim_instantiation == p.head_dim_v_instantiation);
      CHECK(p.block.x == 128 && p.block.y == 1 && p.block.z == 1);
      CHECK(p.block_m >= 16 && p.block_m <= 64 && p.block_n == 32);
      CHECK(!p.tensor_cores || p.block_m == 64);
      const int64_t tiles = (sh[2] + p.block_m - 1) / p.block_m;
      CHECK(static_cast<int64_t>(p.grid.x) == sh[0] * sh[1] * tiles && p.grid.y == 1 && p.grid.z == 1);
      CHECK(static_cast<int64_t>(p.grid.x) * p.block_m >= sh[0] * sh[1] * sh[2]);
      const int d = p.head_dim_instantiation, dv = p.head_dim_v_instantiation;  // sm_90: the preferred tiles
      CHECK(p.shared_memory_bytes == (p.tensor_cores ? cross_attention_wmma_smem_bytes(d, kCrossAttentionWmmaWarps)
                                                     : cross_attention_fwd_smem_bytes(d, dv, cross_attention_fwd_rows_per_warp(dv))));
    }
  }
  const CrossAttentionLaunchPlan d40 = plan_cross_attention_fwd(2, 2, 64, 64, 40, 40, ScalarType::kFloat16, kSm90, 90);
  CHECK(d40.head_dim_instantiation == 64 && d40.head_dim_v_instantiation == 64);

  // Every preferred tile fits sm_80's 163 KiB opt-in limit (and therefore sm_90's 227 KiB); the
  // fall-backs of smaller devices are checked by csrc/tests/cuda_plan_limits_test.cpp.
  for (int d : {32, 64, 128, 256}) {
    for (int dv : {32, 64, 128, 256}) {
      for (int rows : {1, 2, 4, 8}) {
        CHECK(cross_attention_fwd_smem_bytes(d, dv, rows) % 16 == 0);  // float4 reads of the K tile
      }
      CHECK(cross_attention_fwd_smem_bytes(d, dv, cross_attention_fwd_rows_per_warp(dv)) <= 163u * 1024u);
    }
    for (int warps : {1, 2, 4}) {
      CHECK(cross_attention_wmma_smem_bytes(d, warps) % 32 == 0);  // load/store alignment of the next block's view
    }
    CHECK(cross_attention_wmma_smem_bytes(d, kCrossAttentionWmmaWarps) <= 163u * 1024u);
  }
  // Tensor cores: D = 40, Dv = 200 share the 256 instantiation.
  const CrossAttentionLaunchPlan tc = plan_cross_attention_fwd(1, 1, 8, 8, 40, 200, ScalarType::kBFloat16, kSm90, 90);
  CHECK(tc.tensor_cores && tc.head_dim_instantiation == 256 && tc.head_dim_v_instantiation == 256);

  const auto rejected = [](const CrossAttentionLaunchPlan& p) { return !p.supported && p.error != nullptr; };
  CHECK(rejected(plan_cross_attention_fwd(1, 1, 8, 8, 300, 64, ScalarType::kFloat32, kSm90, 90)));
  CHECK(rejected(plan_cross_attention_fwd(1, 1, 8, 8, 64, 300, ScalarType::kFloat32, kSm90, 90)));
  CHECK(rejected(plan_cross_attention_fwd(1, 1, 8, 8, 0, 64, ScalarType::kFloat32, kSm90, 90)));
  CHECK(rejected(plan_cross_attention_fwd(-1, 1, 8, 8, 64, 64, ScalarType::kFloat32, kSm90, 90)));
  CHECK(rejected(plan_cross_attention_fwd(1, 1, 8, 8, 64, 64, static_cast<ScalarType>(7), kSm90, 90)));
  CHECK(rejected(plan_cross_attention_fwd(1 << 20, 1 << 20, 1 << 20, 8, 64, 64, ScalarType::kFloat32, kSm90, 90)));
  CHECK(rejected(
      plan_cross_attention_fwd(INT64_MAX, INT64_MAX, INT64_MAX, 8, 64, 64, ScalarType::kFloat32, kSm90, 90)));

  const CrossAttentionLaunchPlan empty = plan_cross_attention_fwd(4, 0, 8, 8, 64, 64, ScalarType::kFloat32, kSm90, 90);
  CHECK(empty.supported && empty.empty && empty.grid.x == 0);
  // N = 0 is not empty: the kernel still has to write out = 0, lse = −inf.
  const CrossAttentionLaunchPlan no_keys =
      plan_cross_attention_fwd(1, 1, 8, 0, 64, 64, ScalarType::kFloat32, kSm90, 90);
  CHECK(no_keys.supported && !no_keys.empty && no_keys.grid.x == 1);
}

}  // namespace

int main() {
  test_streaming_matches_direct();
  test_large_scores_do_not_overflow();
  test_empty_rows();
  test_nan_never_reads_as_empty();
  test_merge_weights();
  test_merge_of_splits_equals_whole();
  test_launch_plan();
  if (g_failures != 0) {
    std::fprintf(stderr, "attn_ext_header_tests: %d check(s) failed\n", g_failures);
    return g_failures > 100 ? 100 : g_failures;
  }
  std::printf("attn_ext_header_tests: all checks passed\n");
  return 0;
}
