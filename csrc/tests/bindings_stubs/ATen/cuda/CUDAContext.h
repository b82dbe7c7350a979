// Stand-in for the CUDA build of torch's <ATen/cuda/CUDAContext.h>, only for type-checking the CUDA
// torch bindings against a CPU build of torch (.ci/bindings_syntax_check.sh); never linked or run.
#pragma once

#include <cuda_runtime_api.h>

namespace at {
namespace cuda {
struct CUDAStream {
  operator cudaStream_t() const { return nullptr; }
};
inline CUDAStream getCurrentCUDAStream() { return {}; }
}  // namespace cuda
}  // namespace at
