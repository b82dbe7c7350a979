// Helpers shared by the torch bindings of the CUDA kernels in this directory: tensor dtype → kernel
// ScalarType, device checks, the bytes of a bool mask, the q/k/v layout of the kernels' params, the
// device's shared-memory limit and plan errors, launch errors. The argument checks proper are shared
// with the CPU ops (csrc/checks/).
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <optional>
#include <string>

#include "checks/common.h"
#include "cuda/common/compute_capability.h"
#include "cuda/common/device_limits.h"
#include "cuda/common/launch_geometry.h"
#include "cuda/common/qkv_layout.h"
#include "cuda/common/smem_limits.h"

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

/// The layout part of a kernel's params from its q, k and v (unit inner stride; v undefined without
/// values) and its mask bytes (undefined without a mask).
inline void fill_qkv_layout(QkvLayout& l, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& mask, double scale, ScalarType dtype) {
  l.q_stride_b = q.stride(0), l.q_stride_h = q.stride(1), l.q_stride_m = q.stride(2);
  l.k_stride_b = k.stride(0), l.k_stride_h = k.stride(1), l.k_stride_n = k.stride(2);
  if (v.defined()) l.v_stride_b = v.stride(0), l.v_stride_h = v.stride(1), l.v_stride_n = v.stride(2);
  if (mask.defined()) l.mask_stride_b = mask.stride(0);
  l.scale = static_cast<float>(scale);
  l.dtype = dtype;
}

/// The opt-in shared memory per block of `device`, which the plans are given (the launchers read the
/// same cached value for the current device, which the bindings set to this one before launching).
inline std::size_t smem_limit_of(const at::Device& device, const char* op) {
  std::size_t bytes = 0;
  const cudaError_t err = smem_optin_limit(device.index(), &bytes);
  TORCH_CHECK(err == cudaSuccess, "attn_ext.", op, ": cannot read the shared-memory limit of ", device, ": ",
              cudaGetErrorString(err));
  return bytes;
}

/// The compute capability of `device` (major·10 + minor), which the tensor-core plans are given.
inline int capability_of(const at::Device& device, const char* op) {
  int capability = 0;
  const cudaError_t err = compute_capability(device.index(), &capability);
  TORCH_CHECK(err == cudaSuccess, "attn_ext.", op, ": cannot read the compute capability of ", device, ": ",
              cudaGetErrorString(err));
  return capability;
}

/// Raises for a plan that is not supported: RuntimeError when no tile of the kernel fits this GPU's
/// shared memory or its tensor cores lack the dtype (limits of the device, not of the arguments: the
/// message names the kernel, the bytes it needs and the device's limit, or the capability the dtype
/// needs and the device's), ValueError for a shape the kernels do not take. `describe()` returns the
/// text naming the call's arguments: called only on failure, so a supported call formats nothing.
template <typename Plan, typename Describe>
void check_plan(const Plan& plan, const char* op, Describe&& describe) {
  if (plan.supported) return;
  const std::string message = plan_error_message(plan.error, plan.smem);
  const std::string got = describe();
  TORCH_CHECK(plan.smem.kernel == nullptr && !is_capability_error(plan.error), "attn_ext.", op, " (CUDA): ", message, "; got ", got);
  TORCH_CHECK_VALUE(false, "attn_ext.", op, " (CUDA): ", message, "; got ", got);
}

inline void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "attn_ext.", op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

}  // namespace bindings
}  // namespace cuda
}  // namespace attn_ext
