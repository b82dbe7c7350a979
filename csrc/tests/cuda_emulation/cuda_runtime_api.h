// Host-emulation shim for <cuda_runtime_api.h>: just the types the attn_ext launch interface names.
// Only on the include path of the emulation test, never of real CUDA builds.
#pragma once

enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
typedef struct CUstream_st* cudaStream_t;
