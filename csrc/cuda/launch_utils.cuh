// A kernel launch with a planned amount of dynamic shared memory, shared by the launchers.
#pragma once

#include <cstddef>

#include <cuda_runtime.h>

#include "launch_plan.h"

namespace attn_ext {
namespace cuda {
namespace detail {

/// Above this a kernel must opt in to more dynamic shared memory (sm_80: up to 163 KiB, sm_90: 227 KiB).
constexpr std::size_t kDefaultDynamicSmemLimit = 48 * 1024;

/// Launches `kernel<<<grid, block, smem_bytes, stream>>>(args...)`, opting in to more than 48 KiB of
/// dynamic shared memory when needed; returns the first CUDA error.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_with_smem(void (*kernel)(KernelArgs...), LaunchDims grid, LaunchDims block, std::size_t smem_bytes,
                             cudaStream_t stream, const Args&... args) {
  if (smem_bytes > kDefaultDynamicSmemLimit) {
    // Idempotent and cheap; doing it per launch avoids per-device bookkeeping of "already opted in".
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes));
    if (err != cudaSuccess) return err;
  }
  kernel<<<dim3(grid.x, grid.y, grid.z), dim3(block.x, block.y, block.z), smem_bytes, stream>>>(args...);
  return cudaGetLastError();
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
