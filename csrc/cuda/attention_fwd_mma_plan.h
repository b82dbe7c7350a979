// Tiles of the FlashAttention-2-style forward (attention_fwd_mma_kernel.cuh), as plain C++17 so that the
// launcher, the kernel's static_asserts and the host tests share one definition.
//
// The kernel runs fp16/bf16 from sm_80 on (mma.sync m16n8k16, ldmatrix, cp.async). It loads q, k and v
// rows in 16-byte pieces, so it needs every row to start on a 16-byte boundary and D, Dv to be
// multiples of 8: mma_fwd_ineligible() says which condition fails, and the launcher takes the WMMA
// kernel for those problems (and below sm_80) instead.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "common/qkv_layout.h"

namespace attn_ext {
namespace cuda {

/// One head-dim bucket's tile: warps per block, 16-row MMA tiles per warp, keys per shared-memory tile.
/// Each warp keeps its rows' output accumulator in registers (kMTiles·16 rows × dim fp32 over 32
/// lanes: 128 registers per lane at dim 128 with 2 tiles) and its score tile (kMTiles·16 × block_n);
/// two row tiles per warp reuse every K and V fragment twice, which halves the shared-memory reads per
/// MMA (FlashAttention-2's 128-row blocks of 4 warps). dim 256 keeps one row tile to stay in registers.
struct MmaFwdTile {
  int warps, m_tiles, block_n;
  constexpr int block_m() const { return warps * 16 * m_tiles; }
};

constexpr MmaFwdTile mma_fwd_tile(int dim) {
  return dim <= 64 ? MmaFwdTile{4, 2, 64} : dim <= 128 ? MmaFwdTile{4, 2, 32} : MmaFwdTile{4, 1, 32};
}

/// Row stride (elements) of the 16-bit tiles in shared memory: 16 extra bytes shift consecutive rows by
/// four banks, so the 8 row addresses of one ldmatrix matrix (16 bytes each) hit 8 distinct bank groups.
constexpr int mma_fwd_smem_stride(int dim) { return dim + 8; }

/// Dynamic shared memory: Q [block_m][stride], K and V [block_n][stride] (16-bit, one buffer each: the
/// next K tile loads while P·V runs, the V tile while Q·Kᵀ runs), and the key bias (0 or −inf) of two
/// consecutive key tiles in fp32.
constexpr std::size_t mma_fwd_smem_bytes(int dim) {
  return 2 * static_cast<std::size_t>(mma_fwd_tile(dim).block_m() + 2 * mma_fwd_tile(dim).block_n) *
             mma_fwd_smem_stride(dim) +
         4 * 2 * static_cast<std::size_t>(mma_fwd_tile(dim).block_n);
}

/// Why the mma kernel cannot take a problem whose rows start at these element offsets (pointers as
/// integers, strides in 2-byte elements), or nullptr when it can.
inline const char* mma_fwd_ineligible(int compute_capability, int64_t D, int64_t Dv, const void* q, const void* k,
                                      const void* v, const int64_t* strides, int num_strides) {
  if (compute_capability < 80) return "mma.sync m16n8k16 and cp.async need compute capability 8.0";
  if (D % 8 != 0 || Dv % 8 != 0) return "D and Dv must be multiples of 8 (16-byte row pieces)";
  const auto aligned = [](const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; };
  if (!aligned(q) || !aligned(k) || !aligned(v)) return "q, k and v must start on 16-byte boundaries";
  for (int i = 0; i < num_strides; ++i) {
    if (strides[i] % 8 != 0) return "every batch, head and row stride must be a multiple of 8 elements";
  }
  return nullptr;
}

/// mma_fwd_ineligible over the rows of q, k and v as `l` lays them out (batch, head and row strides), plus
/// `more` strides of other tensors the kernels load the same way (the backward's dO).
inline const char* mma_qkv_ineligible(int compute_capability, int64_t D, int64_t Dv, const void* q, const void* k,
                                      const void* v, const QkvLayout& l, std::initializer_list<int64_t> more = {}) {
  int64_t strides[16] = {l.q_stride_b, l.q_stride_h, l.q_stride_m, l.k_stride_b, l.k_stride_h,
                         l.k_stride_n, l.v_stride_b, l.v_stride_h, l.v_stride_n};
  int count = 9;
  for (const int64_t s : more) {
    if (count == 16) return "too many strides for one check";
    strides[count++] = s;
  }
  return mma_fwd_ineligible(compute_capability, D, Dv, q, k, v, strides, count);
}

}  // namespace cuda
}  // namespace attn_ext
