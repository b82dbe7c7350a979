// Conversions between the kernels' storage types (float, __half, __nv_bfloat16) and fp32, the type
// every CUDA kernel computes in (attn_ext/scalar_type.h's accumulation rule for these inputs).
//
// Also compiled by g++ in the host emulation tests (csrc/tests/cuda_emulation/ shims the CUDA headers).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "attn_ext/scalar_type.h"

namespace attn_ext {
namespace cuda {
namespace detail {

static_assert(sizeof(acc_type<__half>) == 4 && sizeof(acc_type<__nv_bfloat16>) == 4 && sizeof(acc_type<float>) == 4,
              "the CUDA kernels accumulate every dtype they take in fp32");

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

/// Round-to-nearest-even conversion of an fp32 value to the storage type.
template <typename scalar_t>
__device__ __forceinline__ scalar_t from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
