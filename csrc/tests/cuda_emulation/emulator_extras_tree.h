// Additions to the host CUDA emulator (cuda_emulator.h) for the Tree Cross Attention, Intention and
// batched Cholesky kernels, kept in their own header so that emulator extensions for other kernels
// do not collide: __syncwarp, and a whole-grid launch helper.
#pragma once

#include <cstring>

#include "cuda_emulator.h"

/// The emulator runs every fiber of the block up to its next synchronisation point before resuming
/// any, so a warp barrier is emulated as a (stronger) block-wide one, like the shuffles. Kernels
/// using it must execute the same sequence of __syncwarp calls in every warp (ours do: their loops
/// have block-uniform trip counts); the scheduler aborts otherwise.
/// A template on purpose: if cuda_emulator.h (extended in parallel for other kernels) defines the
/// same non-template function, overload resolution prefers that one and this stays unused, instead
/// of the two colliding as redefinitions.
template <typename = void>
inline void __syncwarp(unsigned int mask = 0xffffffffu) {
  if (mask != 0xffffffffu) ::cuda_emu::fail("only full-warp __syncwarp is emulated");
  ::cuda_emu::yield(::cuda_emu::Sync::kShuffle);
}

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

/// Fibers run one at a time on one OS thread and switch only at synchronisation points, so a plain
/// read-modify-write is atomic here. A template for the same reason as __syncwarp above.
template <typename T>
inline T atomicAdd(T* address, T value) {
  const T old = *address;
  *address = old + value;
  return old;
}

namespace attn_ext {
namespace cuda {
namespace detail {
/// Definition of the kernels' `extern __shared__ float4 smem_raw[]` (the dynamic shared memory) for
/// the emulated tests: sm_90's opt-in maximum, so any planned size fits.
alignas(16) inline float4 smem_raw[227 * 1024 / sizeof(float4)];
}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
