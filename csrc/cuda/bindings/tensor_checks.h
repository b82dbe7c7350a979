// Helpers shared by the torch bindings of the CUDA kernels in this directory: tensor dtype → kernel
// ScalarType, device checks, the bytes of a bool mask, launch errors. The argument checks proper are
// shared with the CPU ops (csrc/checks/).
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <optional>

#include "checks/common.h"
#include "cuda/common/launch_geometry.h"

namespace attn_ext {
namespace cuda {
namespace bindings {

/// The kernels' element type for a tensor dtype; fp64 (accepted by the CPU ops for gradcheck) is not.
inline ScalarType kernel_scalar_type(at::ScalarType dtype, const char* op) {
  const std::optional<ScalarType> t = scalar_type_of(dtype);
  TORCH_CHECK_TYPE(t.has_value() && is_attention_dtype(*t), "attn_ext.", op,
                   ": the CUDA kernel supports float32, float16 and bfloat16, got ", dtype,
                   " (float64 runs on the CPU backends)");
  return *t;
}

/// The first input of an op (`what`: "tensors" or its name) is a CUDA tensor: the kernels run there.
inline void check_is_cuda(const at::Tensor& t, const char* what, const char* op) {
  TORCH_CHECK(t.is_cuda(), "attn_ext.", op, ": the CUDA kernel got ", what, " on ", t.device());
}

/// Every tensor of an op must be a CUDA tensor on `device` (the first input's).
inline void check_on_device(const at::Tensor& t, const char* name, const at::Device& device, const char* op) {
  TORCH_CHECK(t.is_cuda() && t.device() == device, "attn_ext.", op, ": ", name, " must be a CUDA tensor on ", device,
              ", got device ", t.device());
}

/// A bool mask as the bytes the kernels read (nonzero = padding), contiguous.
inline at::Tensor mask_bytes(const at::Tensor& mask) { return mask.contiguous().view(at::kByte); }

inline void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "attn_ext.", op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

}  // namespace bindings
}  // namespace cuda
}  // namespace attn_ext
