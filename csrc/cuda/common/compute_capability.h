// Which dtypes the tensor-core kernels take on a device of a given compute capability, and the reason
// a plan gives when they do not.
//
// The WMMA kernels compile for sm_70 and newer, but CUDA has bf16 tensor-core fragments only from
// sm_80 (Ampere): on sm_70/sm_75 the bf16 instantiations compile to a trap (wmma_tiles.cuh), so the
// plans must refuse bf16 there before anything is launched; fp16 and fp32 run. The reason names the
// device's capability, so it is a static string per capability (plans keep `const char*` errors).
//
// Plain C++17 without CUDA headers, like the plans built on it.
#pragma once

#include "attn_ext/scalar_type.h"

namespace attn_ext {
namespace cuda {

/// Compute capabilities are written major·10 + minor (75 for 7.5), as cudaDevAttrComputeCapability*
/// give them and as the sm_XX names read.
constexpr int kBf16TensorCoreMinCapability = 80;

/// The refusals, one per capability below 8.0 that a build can target (7.0 and 7.5; 7.2 is Jetson
/// Xavier), the last for anything older. Inline variables, so that every translation unit sees one
/// address and is_capability_error() can compare pointers.
inline constexpr const char* kBf16CapabilityErrors[] = {
    "bf16 needs compute capability 8.0; this device is 7.0 (use float16 or float32 on it)",
    "bf16 needs compute capability 8.0; this device is 7.2 (use float16 or float32 on it)",
    "bf16 needs compute capability 8.0; this device is 7.5 (use float16 or float32 on it)",
    "bf16 needs compute capability 8.0; this device is older (use float16 or float32 on it)",
};

/// The reason the tensor-core kernels refuse `dtype` on a device of `compute_capability`, or nullptr.
constexpr const char* tensor_core_dtype_error(ScalarType dtype, int compute_capability) {
  if (dtype != ScalarType::kBFloat16 || compute_capability >= kBf16TensorCoreMinCapability) return nullptr;
  return compute_capability == 70   ? kBf16CapabilityErrors[0]
         : compute_capability == 72 ? kBf16CapabilityErrors[1]
         : compute_capability == 75 ? kBf16CapabilityErrors[2]
                                    : kBf16CapabilityErrors[3];
}

/// Whether a plan's error is a refusal of tensor_core_dtype_error(): a limit of the device, not of the
/// arguments (the torch bindings raise RuntimeError for it, as for a shared-memory shortfall).
constexpr bool is_capability_error(const char* error) {
  for (const char* e : kBf16CapabilityErrors) {
    if (error == e) return true;
  }
  return false;
}

}  // namespace cuda
}  // namespace attn_ext
