// Host-side launch helpers shared by the launchers (*.cu): the dynamic shared-memory opt-in and the
// dispatch from a runtime ScalarType (and head-dim bucket, and tile size) to a kernel instantiation.
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

/// Calls f(std::integral_constant<int, dim>{}) for a head-dim bucket of the tensor-core kernels (32,
/// 64, 128 or 256); cudaErrorInvalidValue for anything else.
template <typename F>
cudaError_t dispatch_head_dim_bucket(int dim, F&& f) {
  switch (dim) {
    case 32: return f(std::integral_constant<int, 32>{});
    case 64: return f(std::integral_constant<int, 64>{});
    case 128: return f(std::integral_constant<int, 128>{});
    case 256: return f(std::integral_constant<int, 256>{});
    default: return cudaErrorInvalidValue;
  }
}

/// Calls f(scalar_t{}, std::integral_constant<int, dim>{}) for the tensor-core instantiations: dtype
/// fp16 or bf16, head-dim bucket 32, 64, 128 or 256; cudaErrorInvalidValue for anything else.
template <typename F>
cudaError_t dispatch_tensor_core(ScalarType dtype, int dim, F&& f) {
  const auto by_dim = [&](auto scalar) -> cudaError_t {
    return dispatch_head_dim_bucket(dim, [&](auto bucket) { return f(scalar, bucket); });
  };
  switch (dtype) {
    case ScalarType::kFloat16: return by_dim(__half{});
    case ScalarType::kBFloat16: return by_dim(__nv_bfloat16{});
    default: return cudaErrorInvalidValue;
  }
}

/// Calls f(std::integral_constant<int, t>{}) for a plan's tile size t in {16, 8, 4, 2, 1} (warps per
/// block, rows per warp) when `compiled(t)` holds, i.e. the kernel has that instantiation
/// (common/smem_limits.h); cudaErrorInvalidValue otherwise. `compiled` is a captureless constexpr
/// lambda, evaluated at compile time, so no other tile is instantiated.
template <typename Compiled, typename F>
cudaError_t dispatch_tile(int tile, Compiled compiled, F&& f) {
  const auto call = [&](auto t) -> cudaError_t {
    if constexpr (compiled(decltype(t)::value)) {
      return f(t);
    } else {
      return cudaErrorInvalidValue;
    }
  };
  switch (tile) {
    case 16: return call(std::integral_constant<int, 16>{});
    case 8: return call(std::integral_constant<int, 8>{});
    case 4: return call(std::integral_constant<int, 4>{});
    case 2: return call(std::integral_constant<int, 2>{});
    case 1: return call(std::integral_constant<int, 1>{});
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
