// Host-side launch helpers shared by the launchers (*.cu): the dynamic shared-memory opt-in and the
// dispatch from a runtime ScalarType (and head-dim bucket) to a kernel instantiation.
#pragma once

#include <cstddef>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cuda_runtime.h>

#include "launch_geometry.h"

namespace attn_ext {
namespace cuda {
namespace detail {

/// Launches `kernel<<<grid, block, smem_bytes, stream>>>(args...)`, opting in to more than 48 KiB of
/// dynamic shared memory when needed; returns the first CUDA error.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_with_smem(void (*kernel)(KernelArgs...), LaunchDims grid, LaunchDims block, std::size_t smem_bytes,
                             cudaStream_t stream, const Args&... args) {
  if (smem_bytes > kDefaultDynamicSmemBytes) {
    // Idempotent and cheap; doing it per launch avoids per-device bookkeeping of "already opted in".
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes));
    if (err != cudaSuccess) return err;
  }
  kernel<<<dim3(grid.x, grid.y, grid.z), dim3(block.x, block.y, block.z), smem_bytes, stream>>>(args...);
  return cudaGetLastError();
}

/// Calls f(scalar_t{}) with the storage type of an attention dtype (float, __half, __nv_bfloat16);
/// cudaErrorInvalidValue for any other dtype.
template <typename F>
cudaError_t dispatch_attention_dtype(ScalarType dtype, F&& f) {
  switch (dtype) {
    case ScalarType::kFloat32: return f(float{});
    case ScalarType::kFloat16: return f(__half{});
    case ScalarType::kBFloat16: return f(__nv_bfloat16{});
    default: return cudaErrorInvalidValue;
  }
}

/// Calls f(scalar_t{}, std::integral_constant<int, dim>{}) for the tensor-core instantiations: dtype
/// fp16 or bf16, head-dim bucket 32, 64, 128 or 256; cudaErrorInvalidValue for anything else.
template <typename F>
cudaError_t dispatch_tensor_core(ScalarType dtype, int dim, F&& f) {
  const auto by_dim = [&](auto scalar) -> cudaError_t {
    switch (dim) {
      case 32: return f(scalar, std::integral_constant<int, 32>{});
      case 64: return f(scalar, std::integral_constant<int, 64>{});
      case 128: return f(scalar, std::integral_constant<int, 128>{});
      case 256: return f(scalar, std::integral_constant<int, 256>{});
      default: return cudaErrorInvalidValue;
    }
  };
  switch (dtype) {
    case ScalarType::kFloat16: return by_dim(__half{});
    case ScalarType::kBFloat16: return by_dim(__nv_bfloat16{});
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
