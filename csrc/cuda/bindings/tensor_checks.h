// Small helpers shared by the torch bindings of the CUDA kernels in this directory (tree.cpp,
// intention.cpp): tensor → kernel dtype, device checks, unit inner stride, launch errors.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include "cuda/common/launch_geometry.h"

namespace attn_ext {
namespace cuda {
namespace bindings {

/// The kernels' element type for a tensor dtype; fp64 (accepted by the CPU ops for gradcheck) is not.
inline ScalarType kernel_scalar_type(at::ScalarType dtype, const char* op) {
  switch (dtype) {
    case at::kFloat: return ScalarType::kFloat32;
    case at::kHalf: return ScalarType::kFloat16;
    case at::kBFloat16: return ScalarType::kBFloat16;
    default:
      TORCH_CHECK_TYPE(false, "attn_ext.", op, ": the CUDA kernel supports float32, float16 and bfloat16, got ",
                       dtype, " (float64 runs on the CPU backends)");
  }
  return ScalarType::kFloat32;  // unreachable
}

/// Every tensor of an op must be a CUDA tensor on `device` (the first input's).
inline void check_on_device(const at::Tensor& t, const char* name, const at::Device& device, const char* op) {
  TORCH_CHECK(t.is_cuda() && t.device() == device, "attn_ext.", op, ": ", name, " must be a CUDA tensor on ", device,
              ", got device ", t.device());
}

/// The kernels take any outer strides but need unit stride in the innermost dimension.
inline at::Tensor with_unit_inner_stride(const at::Tensor& t) {
  return t.dim() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

/// A bool mask as the bytes the kernels read (nonzero = padding), contiguous.
inline at::Tensor mask_bytes(const at::Tensor& mask) { return mask.contiguous().view(at::kByte); }

inline void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "attn_ext.", op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

}  // namespace bindings
}  // namespace cuda
}  // namespace attn_ext
