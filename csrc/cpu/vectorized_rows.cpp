#include "vectorized_rows.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "cpu_clones.h"

namespace attn_ext::cpu {
namespace {

// exp(x) for x ≤ 0 as 2^n · e^r (Cody–Waite split of ln 2, Cephes' degree-6 polynomial on
// |r| ≤ ln2/2): about 2 ulp, branch-free so the loops vectorise. Arguments below the smallest
// normal float's log return exactly 0, which is what −inf scores of padded keys must become.
inline float exp_nonpositive(float x) {
  constexpr float kLowest = -87.33654475f;  // log(FLT_MIN)
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kRound = 12582912.0f;  // 1.5·2^23: adding it rounds to an integer
  const float xc = x < kLowest ? kLowest : (x > 0.0f ? 0.0f : x);
  const float n = (xc * kLog2e + kRound) - kRound;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return x < kLowest ? 0.0f : p * two_n;
}

}  // namespace

ATTN_EXT_CPU_CLONES float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  // omp simd licenses the reordered (vector-lane) reduction that IEEE rules forbid by default; the
  // order is still fixed at compile time, so results stay bit-identical run to run.
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

ATTN_EXT_CPU_CLONES float exp_shifted_inplace_sum(float* x, int64_t n, float shift) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float e = exp_nonpositive(x[i] - shift);
    x[i] = e;
    sum += e;
  }
  return sum;
}

ATTN_EXT_CPU_CLONES void score_gradient_row(const float* p, const float* dp, float* ds, int64_t n,
                                            float delta_minus_dlse) {
  for (int64_t i = 0; i < n; ++i) ds[i] = p[i] * (dp[i] - delta_minus_dlse);
}

// fp64 exists for gradcheck: exactness matters, speed does not.
double row_max(const double* x, int64_t n) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

double exp_shifted_inplace_sum(double* x, int64_t n, double shift) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    sum += x[i];
  }
  return sum;
}

void score_gradient_row(const double* p, const double* dp, double* ds, int64_t n, double delta_minus_dlse) {
  for (int64_t i = 0; i < n; ++i) ds[i] = p[i] * (dp[i] - delta_minus_dlse);
}

}  // namespace attn_ext::cpu
