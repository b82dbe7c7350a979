// The opt-in shared memory per block of a CUDA device (cudaDevAttrMaxSharedMemoryPerBlockOptin), which
// every launch plan is given: read once per device and cached, since the launchers and the torch
// bindings ask for it on every call. Host code only; defined in csrc/cuda/device_limits.cu.
#pragma once

#include <cstddef>

#include <cuda_runtime_api.h>

namespace attn_ext {
namespace cuda {

/// The opt-in shared memory per block of `device`, in bytes. Thread-safe; an error (an invalid
/// device, no driver) is returned, not cached.
cudaError_t smem_optin_limit(int device, std::size_t* bytes);

/// The same for the current device (cudaGetDevice), the one a launcher enqueues on.
cudaError_t current_smem_optin_limit(std::size_t* bytes);

}  // namespace cuda
}  // namespace attn_ext
