// Portability macros shared by the CPU (g++) and CUDA (nvcc) builds of the per-tile math.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define ATTN_EXT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ATTN_EXT_HOST_DEVICE inline
#endif

#include <math.h>

namespace attn_ext {

// Overloads rather than std:: calls: std::exp is not callable from device code, while the C math
// functions are declared for host and device by both compilers.
ATTN_EXT_HOST_DEVICE float math_exp(float x) { return expf(x); }
ATTN_EXT_HOST_DEVICE double math_exp(double x) { return exp(x); }
ATTN_EXT_HOST_DEVICE float math_log(float x) { return logf(x); }
ATTN_EXT_HOST_DEVICE double math_log(double x) { return log(x); }
ATTN_EXT_HOST_DEVICE float math_log1p(float x) { return log1pf(x); }
ATTN_EXT_HOST_DEVICE double math_log1p(double x) { return log1p(x); }
ATTN_EXT_HOST_DEVICE float math_sqrt(float x) { return sqrtf(x); }
/// a / b within 2 ulp for |b| in [2^-126, 2^126]: on the device without the IEEE division's subroutine call.
ATTN_EXT_HOST_DEVICE float math_fast_divide(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdividef(a, b);
#else
  return a / b;
#endif
}
ATTN_EXT_HOST_DEVICE double math_sqrt(double x) { return sqrt(x); }

template <typename T>
ATTN_EXT_HOST_DEVICE T negative_infinity() {
  return -static_cast<T>(HUGE_VAL);
}

/// A quiet NaN, written as inf − inf because HUGE_VAL is usable in device code under both compilers
/// (std::numeric_limits is not, without nvcc's relaxed constexpr). Nothing is built with fast-math,
/// so the expression is not folded away.
template <typename T>
ATTN_EXT_HOST_DEVICE T quiet_nan() {
  const T inf = static_cast<T>(HUGE_VAL);
  return inf - inf;
}

template <typename T>
ATTN_EXT_HOST_DEVICE bool is_negative_infinity(T x) {
  return x == negative_infinity<T>();
}

}  // namespace attn_ext
