// A tiny host emulator for CUDA kernel *source*, so the kernels can be tested on machines without a
// GPU (the dev boxes have nvcc but no device). Test-only: the directory holding this file shadows
// <cuda_runtime.h>, <cuda_fp16.h> and <cuda_bf16.h> for g++.
//
// Model: one block at a time; each CUDA thread is a ucontext fiber on one OS thread. Every
// synchronisation point (__syncthreads, __shfl*_sync) yields to a scheduler, which runs all fibers up
// to their next synchronisation point before resuming any, i.e. it treats each of them as a
// block-wide barrier. That is exact for kernels whose warps all execute the same sequence of
// synchronisation points (true of ours) and the scheduler aborts when they do not, rather than
// silently emulating something a GPU would not do. Shared memory is whatever namespace-scope array
// the test defines for the kernel's `extern __shared__` declaration.
//
// Only the builtins our kernels use are provided; add more as kernels need them. The sm_80
// tensor-core primitives (mma.sync, ldmatrix, cp.async of common/mma_sm80.cuh) are emulated in
// mma_sm80_emulation.h on the mailboxes and per-thread state below.
#pragma once

#include <ucontext.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <math.h>
#include <vector>

#include "cuda_runtime_api.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__
#define __launch_bounds__(...)

struct alignas(16) float4 {
  float x, y, z, w;
};
struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

// Storage-only 16-bit types with the conversion intrinsics the kernels use. Conversions round to
// nearest even, as __float2half_rn / __float2bfloat16_rn do.
struct __half {
  uint16_t bits;
};
inline float __half2float(__half h) {
  _Float16 f;
  std::memcpy(&f, &h.bits, sizeof f);
  return static_cast<float>(f);
}
inline __half __float2half_rn(float x) {
  const _Float16 f = static_cast<_Float16>(x);
  __half h;
  std::memcpy(&h.bits, &f, sizeof f);
  return h;
}
struct __nv_bfloat16 {
  uint16_t bits;
};
inline float __bfloat162float(__nv_bfloat16 b) {
  const uint32_t u = static_cast<uint32_t>(b.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{0x7fc0};  // NaN stays (quiet) NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{static_cast<uint16_t>(u >> 16)};
}

namespace cuda_emu {

enum class Sync { kRunning, kSyncThreads, kShuffle, kDone };

/// A cp.async copy of 16 bytes not yet performed (mma_sm80_emulation.h); !valid: zero-fill.
struct AsyncCopy {
  void* dst;
  const void* src;
  bool valid;
};

struct Fiber {
  ucontext_t context;
  uint3 thread_idx;
  unsigned int linear_id = 0;
  Sync sync = Sync::kRunning;
  unsigned int shuffle_generation = 0;
  unsigned int or_generation = 0;      ///< __syncthreads_or calls so far
  unsigned int tensor_generation = 0;  ///< mma / ldmatrix calls so far (mma_sm80_emulation.h)
  // This thread's cp.async copies, performed only at its cp_async_wait (mma_sm80_emulation.h), so
  // shared memory read before the wait is stale as on a GPU: the committed groups, oldest first,
  // and the copies issued since the last commit.
  std::vector<std::vector<AsyncCopy>> async_groups;
  std::vector<AsyncCopy> async_open;
};

struct Block {
  std::vector<Fiber> fibers;
  std::vector<std::vector<char>> stacks;
  ucontext_t scheduler;
  int current = -1;
  std::function<void()> body;
  uint3 block_idx{0, 0, 0};
  dim3 block_dim, grid_dim;
  // Shuffle mailboxes [generation parity][warp][lane]: a value written in generation g is read
  // after the barrier of g, and the slot is rewritten only in g + 2, after everyone has read it.
  uint32_t mailbox[2][32][32];
  // __syncthreads_or's predicates [generation parity][thread], reused like the mailboxes.
  unsigned char or_slots[2][1024];
  // The warp-collective tensor-core operations (mma_sm80_emulation.h), [generation parity][warp][lane]
  // like the shuffle mailboxes: each lane's stamp (its generation and operation, so that a warp
  // whose lanes do not all execute the same collective aborts instead of mixing operands), its mma
  // operands (A's four and B's two registers), its ldmatrix row address (shared window), and the
  // ldmatrix fragments gathered for it.
  uint32_t tensor_stamp[2][32][32];
  uint32_t mma_operands[2][32][32][6];
  uint32_t ldmatrix_rows[2][32][32];
  uint32_t ldmatrix_fragments[2][32][32][4];
};

inline Block& block() {
  static Block b;
  return b;
}
inline Fiber& self() { return block().fibers[static_cast<size_t>(block().current)]; }

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "cuda_emulator: %s\n", what);
  std::abort();
}

inline void yield(Sync kind) {
  Fiber& f = self();
  f.sync = kind;
  swapcontext(&f.context, &block().scheduler);
}

inline void fiber_entry() {
  block().body();
  // A GPU thread that exits with cp.async copies in flight leaves shared memory in an unknown state;
  // a kernel must wait for all of them (cp_async_wait<0>). Committed empty groups copy nothing.
  bool pending = !self().async_open.empty();
  for (const std::vector<AsyncCopy>& group : self().async_groups) pending = pending || !group.empty();
  if (pending) fail("a thread finished with cp.async copies not waited for");
  self().sync = Sync::kDone;  // returning resumes the scheduler through uc_link
}

/// Runs `body` (the kernel call) as every thread of block `block_idx`; returns when all finished.
inline void run_block(dim3 grid_dim, dim3 block_idx, dim3 block_dim, std::function<void()> body) {
  constexpr size_t kStackBytes = 256 * 1024;
  Block& b = block();
  const unsigned int n = block_dim.x * block_dim.y * block_dim.z;
  if (n == 0 || n % 32 != 0 || n > 1024) fail("block size must be a positive multiple of 32, at most 1024");
  b.body = std::move(body);
  b.block_idx = uint3{block_idx.x, block_idx.y, block_idx.z};
  b.block_dim = block_dim;
  b.grid_dim = grid_dim;
  b.fibers.assign(n, Fiber{});
  std::memset(b.tensor_stamp, 0, sizeof b.tensor_stamp);  // no stamp of an earlier block can match
  if (b.stacks.size() < n) b.stacks.resize(n, std::vector<char>(kStackBytes));
  for (unsigned int i = 0; i < n; ++i) {
    Fiber& f = b.fibers[i];
    f.linear_id = i;
    f.thread_idx = uint3{i % block_dim.x, (i / block_dim.x) % block_dim.y, i / (block_dim.x * block_dim.y)};
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = b.stacks[i].data();
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &b.scheduler;
    makecontext(&f.context, fiber_entry, 0);
  }
  for (;;) {
    for (unsigned int i = 0; i < n; ++i) {
      if (b.fibers[i].sync == Sync::kDone) continue;
      b.current = static_cast<int>(i);
      swapcontext(&b.scheduler, &b.fibers[i].context);
    }
    const Sync first = b.fibers[0].sync;
    for (const Fiber& f : b.fibers) {
      if (f.sync != first) fail("threads of a block reached different synchronisation points");
    }
    if (first == Sync::kDone) break;
  }
  b.current = -1;
}

template <typename T>
T shuffle(T value, unsigned int mask, int src_lane) {
  static_assert(sizeof(T) == sizeof(uint32_t), "only 32-bit shuffles are emulated");
  if (mask != 0xffffffffu) fail("only full-warp shuffles are emulated");
  Fiber& f = self();
  const unsigned int warp = f.linear_id / 32, parity = f.shuffle_generation++ & 1u;
  std::memcpy(&block().mailbox[parity][warp][f.linear_id % 32], &value, sizeof value);
  yield(Sync::kShuffle);
  std::memcpy(&value, &block().mailbox[parity][warp][static_cast<unsigned int>(src_lane) & 31u], sizeof value);
  return value;
}

}  // namespace cuda_emu

#define threadIdx (::cuda_emu::self().thread_idx)
#define blockIdx (::cuda_emu::block().block_idx)
#define blockDim (::cuda_emu::block().block_dim)
#define gridDim (::cuda_emu::block().grid_dim)

/// Kernels trap in instantiations their architecture cannot run (a bf16 WMMA kernel below sm_80); the
/// host has every type, so the emulator never takes that branch, but the kernels' source names it.
inline void __trap() { ::cuda_emu::fail("__trap() reached"); }

inline void __syncthreads() { ::cuda_emu::yield(::cuda_emu::Sync::kSyncThreads); }
/// __syncthreads() that also returns whether `predicate` was nonzero in any thread of the block: each
/// fiber posts its predicate in a slot of the current generation's parity before the barrier (a slot
/// is rewritten two barriers later, after every fiber has read it), then all read every slot.
inline int __syncthreads_or(int predicate) {
  ::cuda_emu::Block& b = ::cuda_emu::block();
  ::cuda_emu::Fiber& f = ::cuda_emu::self();
  const unsigned int parity = f.or_generation++ & 1u;
  b.or_slots[parity][f.linear_id] = predicate != 0;
  ::cuda_emu::yield(::cuda_emu::Sync::kSyncThreads);
  const unsigned int n = b.block_dim.x * b.block_dim.y * b.block_dim.z;
  int any = 0;
  for (unsigned int i = 0; i < n; ++i) any |= b.or_slots[parity][i];
  return any;
}
template <typename T>
T __shfl_sync(unsigned int mask, T value, int src_lane) {
  return ::cuda_emu::shuffle(value, mask, src_lane);
}
template <typename T>
T __shfl_xor_sync(unsigned int mask, T value, int lane_mask) {
  return ::cuda_emu::shuffle(value, mask, static_cast<int>(::cuda_emu::self().linear_id % 32) ^ lane_mask);
}

/// The emulator runs every fiber of the block up to its next synchronisation point before resuming
/// any, so a warp barrier is emulated as a (stronger) block-wide one, like the shuffles. Kernels
/// using it must execute the same sequence of __syncwarp calls in every warp (ours do: their loops
/// have block-uniform trip counts); the scheduler aborts otherwise.
inline void __syncwarp(unsigned int mask = 0xffffffffu) {
  if (mask != 0xffffffffu) ::cuda_emu::fail("only full-warp __syncwarp is emulated");
  ::cuda_emu::yield(::cuda_emu::Sync::kShuffle);
}

/// Fibers run one at a time on one OS thread and switch only at synchronisation points, so a plain
/// read-modify-write is atomic here.
template <typename T>
inline T atomicAdd(T* address, T value) {
  const T old = *address;
  *address = old + value;
  return old;
}
