// The sm_80 tensor-core primitives of FlashAttention-2-style kernels, as thin wrappers over their PTX:
//  * mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16} (HMMA.16816): D = A·B + C with fp32 C/D;
//  * ldmatrix.sync.aligned.m8n8.{x4,x2}[.trans].shared.b16 (LDSM): MMA fragments from shared memory;
//  * cp.async.cg.shared.global 16 bytes, zero-filled when the source is out of range (LDGSTS.128),
//    with commit_group / wait_group for multi-stage pipelines.
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"; g = lane / 4, t = lane % 4; each
// 32-bit register holds two 16-bit elements, the lower-numbered column / row in the low half):
//   A 16×16 (row-major), MmaA::r[0..3]: (row g, cols 2t, 2t+1), (row g+8, cols 2t, 2t+1),
//                                       (row g, cols 2t+8, 2t+9), (row g+8, cols 2t+8, 2t+9)
//   B 16×8 (k × n),      MmaB::r[0..1]: (rows k = 2t, 2t+1; col n = g), (rows k = 2t+8, 2t+9; col n = g)
//   C/D 16×8 fp32,       MmaC::r[0..3]: (row g, col 2t), (row g, col 2t+1), (row g+8, col 2t), (row g+8, col 2t+1)
// ldmatrix: lanes 8i..8i+7 give the addresses of rows 0..7 of matrix i (x4: i < 4; x2: lanes 0..15);
// register i of lane l receives matrix i's elements (row l/4, cols 2(l%4), 2(l%4)+1), or with .trans
// its elements (rows 2(l%4), 2(l%4)+1; col l/4). So, for a row-major tile T[rows][cols] in shared
// memory, ldmatrix of T's rows gives A fragments of T and B fragments of Tᵀ (K stored [key][d] is the
// B operand of Q·Kᵀ), and ldmatrix.trans of T's rows gives B fragments of T (V stored [key][d] is the
// B operand of P·V).
//
// Under nvcc these are inline PTX for sm_80 and later; device passes for older targets compile empty
// bodies, which the kernels never reach (they trap, and the launch plans take other kernels there:
// kMmaSm80 below). Under g++ (csrc/tests) the host emulator's mma_sm80_emulation.h provides the same
// functions, warp-collective through its mailboxes, so the kernels' fragment indexing is tested on
// machines without a GPU.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/dtypes.cuh"

namespace attn_ext {
namespace cuda {
namespace detail {

/// Register fragments of mma.m16n8k16 with 16-bit A/B and fp32 accumulators (layouts above).
struct MmaA {
  uint32_t r[4];
};
struct MmaB {
  uint32_t r[2];
};
struct MmaC {
  float r[4];
};

/// Whether this compilation pass has the instructions above: device passes for sm_80 and later, the
/// host pass, and the host emulator. A kernel built on them compiles to a trap where this is false.
constexpr bool kMmaSm80 =
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    false;
#else
    true;
#endif

/// Two fp32 values rounded to nearest even into one register of 16-bit elements, `lo` in the low half
/// (the lower column of an A fragment pair).
template <typename scalar_t>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi);

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext

#if defined(__CUDACC__)

namespace attn_ext {
namespace cuda {
namespace detail {

template <>
__device__ __forceinline__ uint32_t pack_pair<__half>(float lo, float hi) {
  const __half2 pair = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&pair);
}
template <>
__device__ __forceinline__ uint32_t pack_pair<__nv_bfloat16>(float lo, float hi) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&pair);
#else
  return 0u;  // not reached: no bf16 tensor-core kernel runs below sm_80
#endif
}

// One asm statement per instruction variant, written once: the qualifiers are string literals pasted
// into the instruction text; the operands are those of the function each macro is used in.
#define ATTN_EXT_MMA_16816(ab)                                                                            \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." ab "." ab ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, " \
               "{%8, %9}, {%0, %1, %2, %3};\n"                                                              \
               : "+f"(acc.r[0]), "+f"(acc.r[1]), "+f"(acc.r[2]), "+f"(acc.r[3])                              \
               : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]))
#define ATTN_EXT_LDMATRIX_X4(trans)                                                                       \
  asm volatile("ldmatrix.sync.aligned.m8n8.x4" trans ".shared.b16 {%0, %1, %2, %3}, [%4];\n"             \
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])                                             \
               : "r"(row))
#define ATTN_EXT_LDMATRIX_X2(trans) \
  asm volatile("ldmatrix.sync.aligned.m8n8.x2" trans ".shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(row))

/// acc += a · b (fp32 accumulation), one warp-collective m16n8k16 MMA of `scalar_t` (__half or
/// __nv_bfloat16) operands.
template <typename scalar_t>
__device__ __forceinline__ void mma_m16n8k16(MmaC& acc, const MmaA& a, const MmaB& b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same<scalar_t, __half>::value) {
    ATTN_EXT_MMA_16816("f16");
  } else {
    ATTN_EXT_MMA_16816("bf16");
  }
#endif
}

/// The 32-bit shared-window address of a pointer into shared memory: what ldmatrix takes. Kernels
/// compute a lane's base address once and add compile-time byte offsets, which become the
/// instructions' immediates instead of 64-bit pointers held in registers.
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/// Four 8×8 matrices of 16-bit elements; `row` is this lane's row address (see the file comment).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  ATTN_EXT_LDMATRIX_X4("");
#endif
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  ATTN_EXT_LDMATRIX_X4(".trans");
#endif
}
/// Two 8×8 matrices: lanes 0..15 give the row addresses (the others' are ignored but must be valid).
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  ATTN_EXT_LDMATRIX_X2("");
#endif
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], uint32_t row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  ATTN_EXT_LDMATRIX_X2(".trans");
#endif
}

#undef ATTN_EXT_MMA_16816
#undef ATTN_EXT_LDMATRIX_X4
#undef ATTN_EXT_LDMATRIX_X2

/// Copies 16 bytes from global `src` to shared `dst` asynchronously, bypassing L1 (.cg); when `valid`
/// is false nothing is read and `dst` gets 16 zero bytes (src-size 0), so rows past the end of a tensor,
/// padded keys and columns past D load as zeros. Both addresses must be 16-byte aligned.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
               "r"(src_bytes));
#endif
}
/// Closes the group of this thread's cp.async issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
/// Waits until at most `kPending` of this thread's committed groups are still in flight (then a
/// barrier makes every thread's copies visible to the block).
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
#endif
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext

#else  // the host emulator (csrc/tests/cuda_emulation on the include path)
#include "mma_sm80_emulation.h"
#endif
