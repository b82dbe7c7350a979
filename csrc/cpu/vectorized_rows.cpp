#include "vectorized_rows.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "simd_vector.h"

namespace attn_ext::cpu {
namespace {

using simd::kLanes;
using simd::select;

template <int VB>
using FloatVec = typename simd::Vector<float, VB>::type;
template <int VB>
using IntVec = typename simd::Vector<float, VB>::mask;

constexpr float kInf = std::numeric_limits<float>::infinity();

// exp(x) for x ≤ 0 as 2^n · e^r (Cody–Waite split of ln 2, Cephes' degree-6 polynomial on
// |r| ≤ ln2/2): about 2 ulp. Written on whole vectors with bitwise selects: left to the
// auto-vectoriser, the same scalar code stayed scalar in the AVX2 copy. Arguments below the smallest
// normal float's log return exactly 0, which is what −inf scores of padded keys must become.
template <int VB>
ATTN_EXT_ALWAYS_INLINE FloatVec<VB> exp_nonpositive(FloatVec<VB> x) {
  using V = FloatVec<VB>;
  constexpr float kLowest = -87.33654475f;  // log(FLT_MIN)
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kRound = 12582912.0f;  // 1.5·2^23: adding it rounds to an integer
  const V zero{}, lowest = zero + kLowest;
  const IntVec<VB> underflow = x < lowest;
  V xc = select<float, VB>(underflow, lowest, x);
  xc = select<float, VB>(xc > zero, zero, xc);
  const V n = (xc * kLog2e + kRound) - kRound;
  V r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const IntVec<VB> two_n_bits = (__builtin_convertvector(n, IntVec<VB>) + 127) << 23;
  // A vector cast between equal sizes reinterprets the bits: 2^n from its exponent field.
  return select<float, VB>(underflow, zero, p * (V)two_n_bits);
}

// The lower and upper halves of a vector, as vectors of half its width.
template <int VB>
ATTN_EXT_ALWAYS_INLINE FloatVec<VB / 2> low_half(const FloatVec<VB>& v) {
  FloatVec<VB / 2> h;
  std::memcpy(&h, &v, VB / 2);
  return h;
}

template <int VB>
ATTN_EXT_ALWAYS_INLINE FloatVec<VB / 2> high_half(const FloatVec<VB>& v) {
  FloatVec<VB / 2> h;
  std::memcpy(&h, reinterpret_cast<const char*>(&v) + VB / 2, VB / 2);
  return h;
}

// Sum and max of the lanes by halving: log2(lanes) vector steps instead of one scalar step per lane
// (lane_max takes vectors without NaN).
template <int VB>
ATTN_EXT_ALWAYS_INLINE float lane_sum(const FloatVec<VB>& v) {
  if constexpr (VB > 16) {
    return lane_sum<VB / 2>(low_half<VB>(v) + high_half<VB>(v));
  } else {
    return (v[0] + v[1]) + (v[2] + v[3]);
  }
}

template <int VB>
ATTN_EXT_ALWAYS_INLINE float lane_max(const FloatVec<VB>& v) {
  if constexpr (VB > 16) {
    const FloatVec<VB / 2> lo = low_half<VB>(v), hi = high_half<VB>(v);
    return lane_max<VB / 2>(select<float, VB / 2>(hi > lo, hi, lo));
  } else {
    const float a = v[0] > v[1] ? v[0] : v[1], b = v[2] > v[3] ? v[2] : v[3];
    return a > b ? a : b;
  }
}

// The last n % W elements of a row go through vectors of half the width while at least that many remain,
// down to 4 lanes, then through the row's last four elements (see kLastLanes). Score rows are short in
// Neural Processes (tens of keys): a tail built lane by lane at the full width cost as much as the rest
// of the row. Rows shorter than four lanes are built lane by lane, padded with `fill`.
template <int VB>
ATTN_EXT_ALWAYS_INLINE FloatVec<VB> load_tail(const float* x, int64_t count, float fill) {
  FloatVec<VB> v;
  for (int j = 0; j < kLanes<float, VB>; ++j) v[j] = j < count ? x[j] : fill;
  return v;
}

template <int VB>
ATTN_EXT_ALWAYS_INLINE void store_tail(float* x, int64_t count, const FloatVec<VB>& v) {
  for (int64_t j = 0; j < count; ++j) x[j] = v[j];
}

// NaN lanes as −inf: the row maximum ignores NaN, as the body's `v > m` selection does (a NaN score
// reaches its row through the exponential instead).
template <int VB>
ATTN_EXT_ALWAYS_INLINE FloatVec<VB> without_nan(const FloatVec<VB>& v) {
  return select<float, VB>(v == v, v, FloatVec<VB>{} - kInf);
}

// The four-lane vector of the last four elements of a row (n ≥ 4) covers its last partial vector: lanes
// before the row's last n % 4 elements are ones already processed. Taken whole, it spares building a
// vector lane by lane, which stalled on store forwarding (a quarter of the exponentials' time at
// 50-key rows).
constexpr int kLastLanes = 4;

/// Lanes at or after `first` of a four-lane vector, the others 0.
ATTN_EXT_ALWAYS_INLINE FloatVec<16> lanes_from(const FloatVec<16>& v, int64_t first) {
  const IntVec<16> index{0, 1, 2, 3};
  return select<float, 16>(index >= static_cast<int32_t>(first), v, FloatVec<16>{});
}

// The max over whole vectors of halving widths, down to four lanes, of x[0..count); the last
// count % 4 elements are left to the caller.
template <int VB>
ATTN_EXT_ALWAYS_INLINE float halving_max(const float* x, int64_t count) {
  if constexpr (VB > 16) {
    constexpr int H = kLanes<float, VB / 2>;
    float here = -kInf;
    if (count >= H) here = lane_max<VB / 2>(without_nan<VB / 2>(simd::load<float, VB / 2>(x))), x += H, count -= H;
    const float rest = halving_max<VB / 2>(x, count);
    return rest > here ? rest : here;
  } else {
    return count >= kLastLanes ? lane_max<VB>(without_nan<VB>(simd::load<float, VB>(x))) : -kInf;
  }
}

// Likewise for the exponentials and their sum.
template <int VB>
ATTN_EXT_ALWAYS_INLINE float halving_exp_sum(float* x, int64_t count, float shift) {
  if constexpr (VB > 16) {
    constexpr int H = kLanes<float, VB / 2>;
    float sum = 0.0f;
    if (count >= H) {
      const FloatVec<VB / 2> e = exp_nonpositive<VB / 2>(simd::load<float, VB / 2>(x) - shift);
      simd::store<float, VB / 2>(x, e);
      sum = lane_sum<VB / 2>(e);
      x += H, count -= H;
    }
    return sum + halving_exp_sum<VB / 2>(x, count, shift);
  } else {
    if (count < kLastLanes) return 0.0f;
    const FloatVec<VB> e = exp_nonpositive<VB>(simd::load<float, VB>(x) - shift);
    simd::store<float, VB>(x, e);
    return lane_sum<VB>(e);
  }
}

template <int VB>
ATTN_EXT_ALWAYS_INLINE float row_max_impl(const float* x, int64_t n) {
  constexpr int W = kLanes<float, VB>;
  FloatVec<VB> m = FloatVec<VB>{} - kInf;
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const FloatVec<VB> v = simd::load<float, VB>(x + i);
    m = select<float, VB>(v > m, v, m);
  }
  float best = lane_max<VB>(m);
  const float tail = halving_max<VB>(x + i, n - i);
  best = tail > best ? tail : best;
  if (n % kLastLanes != 0) {  // overlapping what was seen already changes no maximum
    const FloatVec<16> last = n >= kLastLanes ? simd::load<float, 16>(x + n - kLastLanes)
                                              : load_tail<16>(x, n, -kInf);
    const float m_last = lane_max<16>(without_nan<16>(last));
    best = m_last > best ? m_last : best;
  }
  return best;
}

template <int VB>
ATTN_EXT_ALWAYS_INLINE float exp_shifted_inplace_sum_impl(float* x, int64_t n, float shift) {
  constexpr int W = kLanes<float, VB>;
  const int64_t rest = n % kLastLanes;
  // Read before the loops overwrite the lanes it shares with them: its exponentials are recomputed
  // from the same inputs (the same values), and only its last `rest` lanes enter the sum.
  const FloatVec<16> last = n >= kLastLanes && rest != 0 ? simd::load<float, 16>(x + n - kLastLanes) : FloatVec<16>{};
  FloatVec<VB> sum{};
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const FloatVec<VB> e = exp_nonpositive<VB>(simd::load<float, VB>(x + i) - shift);
    simd::store<float, VB>(x + i, e);
    sum += e;
  }
  float total = lane_sum<VB>(sum) + halving_exp_sum<VB>(x + i, n - i, shift);
  if (rest != 0 && n >= kLastLanes) {
    const FloatVec<16> e = exp_nonpositive<16>(last - shift);
    simd::store<float, 16>(x + n - kLastLanes, e);
    total += lane_sum<16>(lanes_from(e, kLastLanes - rest));
  } else if (rest != 0) {  // a row shorter than four: −inf lanes give 0
    const FloatVec<16> e = exp_nonpositive<16>(load_tail<16>(x, n, -kInf) - shift);
    store_tail<16>(x, n, e);
    total += lane_sum<16>(e);
  }
  return total;
}

template <int VB>
ATTN_EXT_ALWAYS_INLINE void score_gradient_row_impl(const float* p, const float* dp, float* ds, int64_t n,
                                                    float delta_minus_dlse) {
  constexpr int W = kLanes<float, VB>;
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    simd::store<float, VB>(ds + i, simd::load<float, VB>(p + i) * (simd::load<float, VB>(dp + i) - delta_minus_dlse));
  }
  for (; i < n; ++i) ds[i] = p[i] * (dp[i] - delta_minus_dlse);
}

#define ATTN_EXT_ROW_KERNELS(name, target, VB)                                                           \
  target float row_max_##name(const float* x, int64_t n) { return row_max_impl<VB>(x, n); }             \
  target float exp_shifted_inplace_sum_##name(float* x, int64_t n, float shift) {                      \
    return exp_shifted_inplace_sum_impl<VB>(x, n, shift);                                               \
  }                                                                                                     \
  target void score_gradient_row_##name(const float* p, const float* dp, float* ds, int64_t n, float c) { \
    score_gradient_row_impl<VB>(p, dp, ds, n, c);                                                       \
  }                                                                                                     \
  constexpr RowKernels kRowKernels_##name{row_max_##name, exp_shifted_inplace_sum_##name,               \
                                          score_gradient_row_##name};

ATTN_EXT_ROW_KERNELS(baseline, , 16)
#ifdef ATTN_EXT_X86_KERNELS
ATTN_EXT_ROW_KERNELS(avx2, ATTN_EXT_TARGET("arch=x86-64-v3"), 32)
ATTN_EXT_ROW_KERNELS(avx512, ATTN_EXT_TARGET("arch=x86-64-v4"), 64)
#endif

const RowKernels& default_row_kernels() {
  static const RowKernels& kernels = row_kernels(isa_level());
  return kernels;
}

}  // namespace

const RowKernels& row_kernels(IsaLevel level) {
  const IsaLevel cpu = cpu_isa_level();
  if (level > cpu) level = cpu;
  switch (level) {
#ifdef ATTN_EXT_X86_KERNELS
    case IsaLevel::kAvx512: return kRowKernels_avx512;
    case IsaLevel::kAvx2: return kRowKernels_avx2;
#endif
    default: return kRowKernels_baseline;
  }
}

float row_max(const float* x, int64_t n) { return default_row_kernels().row_max(x, n); }

float exp_shifted_inplace_sum(float* x, int64_t n, float shift) {
  return default_row_kernels().exp_shifted_inplace_sum(x, n, shift);
}

void score_gradient_row(const float* p, const float* dp, float* ds, int64_t n, float delta_minus_dlse) {
  default_row_kernels().score_gradient_row(p, dp, ds, n, delta_minus_dlse);
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
