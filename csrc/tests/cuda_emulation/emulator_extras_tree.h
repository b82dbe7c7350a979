// Whole-grid helpers for the host CUDA emulator (cuda_emulator.h) used by the emulation tests: a grid
// launch that checks the planned shared-memory size, and the definition of the kernels' dynamic
// shared memory. (The name predates its use beyond the tree kernels.)
#pragma once

#include <cstring>

#include "cuda_emulator.h"

namespace cuda_emu {

/// Runs `kernel_call` as every block of `grid` in turn. Before each block the dynamic shared memory
/// (`smem`, `smem_total` bytes) is filled with 0xff (a NaN pattern, so reads of unwritten shared
/// memory show up) and afterwards the bytes past `smem_used` are checked to be untouched; returns
/// false if a block wrote past its planned shared memory.
template <typename F>
bool run_grid(dim3 grid, dim3 block_dim, void* smem, size_t smem_total, size_t smem_used, F kernel_call) {
  auto* bytes = static_cast<unsigned char*>(smem);
  bool ok = smem_used <= smem_total;
  for (unsigned int z = 0; z < grid.z; ++z)
    for (unsigned int y = 0; y < grid.y; ++y)
      for (unsigned int x = 0; x < grid.x; ++x) {
        std::memset(bytes, 0xff, smem_total);
        run_block(grid, dim3(x, y, z), block_dim, kernel_call);
        for (size_t i = smem_used; ok && i < smem_total; ++i) ok = bytes[i] == 0xff;
      }
  return ok;
}

}  // namespace cuda_emu

namespace attn_ext {
namespace cuda {
namespace detail {
/// Definition of the kernels' `extern __shared__ float4 smem_raw[]` (the dynamic shared memory) for
/// the emulated tests: sm_90's opt-in maximum, so any planned size fits.
alignas(16) inline float4 smem_raw[227 * 1024 / sizeof(float4)];
}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
