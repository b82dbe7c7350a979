// What every CUDA launch plan shares: a stand-in for dim3, the grid and shared-memory limits the
// plans check against, and the element types of the attention kernels.
//
// Plain C++17 without CUDA headers, like the plans (*_plan.h) built on it: host code compiled by g++
// (the torch bindings, the host tests) then computes exactly the grid, block and shared memory that
// the launchers use, so a shape is rejected with a reason before anything is enqueued.
#pragma once

#include <cstddef>
#include <cstdint>

#include "attn_ext/scalar_type.h"

namespace attn_ext {
namespace cuda {

/// A CUDA-free stand-in for dim3.
struct LaunchDims {
  unsigned int x = 1;
  unsigned int y = 1;
  unsigned int z = 1;
};

/// CUDA's limits on gridDim.x and gridDim.y.
constexpr int64_t kMaxGridX = 2147483647;
constexpr int64_t kMaxGridY = 65535;

/// Dynamic shared memory a kernel gets without opting in (cudaFuncAttributeMaxDynamicSharedMemorySize).
constexpr std::size_t kDefaultDynamicSmemBytes = 48 * 1024;

/// The element types of the CUDA attention, tree and Intention kernels: fp64 runs on the CPU
/// backends (only the Cholesky kernels take it).
constexpr bool is_attention_dtype(ScalarType t) {
  return t == ScalarType::kFloat32 || t == ScalarType::kFloat16 || t == ScalarType::kBFloat16;
}
constexpr const char* kAttentionDtypeError = "unsupported dtype (expected float32, float16 or bfloat16)";

}  // namespace cuda
}  // namespace attn_ext
