// What the launch plans are told about a CUDA device: its opt-in shared memory per block
// (cudaDevAttrMaxSharedMemoryPerBlockOptin), which every plan is given, and its compute capability,
// which the tensor-core plans are given (bf16 needs 8.0, common/compute_capability.h). Read once per
// device and cached, since the launchers and the torch bindings ask on every call. Host code only;
// defined in csrc/cuda/device_limits.cu.
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

/// The compute capability of `device` as major·10 + minor (75 for 7.5). Thread-safe; an error is
/// returned, not cached.
cudaError_t compute_capability(int device, int* capability);

/// The same for the current device (cudaGetDevice).
cudaError_t current_compute_capability(int* capability);

}  // namespace cuda
}  // namespace attn_ext
