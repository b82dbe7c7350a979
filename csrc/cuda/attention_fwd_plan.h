// Launch geometry of the CUDA cross-attention forward kernels (SIMT for fp32, WMMA for fp16/bf16),
// as plain C++17.
//
// Kept free of CUDA headers so that host-only code compiled by g++ (the header tests, and the torch
// binding that reports why a shape is rejected) computes exactly the grid, block and shared-memory
// size that the .cu launcher uses: there is one source of truth for the tiling.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/compute_capability.h"
#include "common/launch_geometry.h"
#include "common/smem_limits.h"

namespace attn_ext {
namespace cuda {

/// Warps per block. Four warps keep a block small enough that short query sets (CMANP's 128 latents)
/// still spread over many SMs, while each key/value tile in shared memory is reused by 4 warps.
constexpr int kCrossAttentionFwdWarps = 4;
/// Keys per shared-memory tile: one key per lane in the score phase, so the tile width is the warp size.
constexpr int kCrossAttentionFwdBlockN = 32;
/// Largest head dimension (D or Dv) with an instantiation.
constexpr int kCrossAttentionFwdMaxHeadDim = 256;

/// The compiled head-dimension instantiation for a runtime head dimension: the next of
/// {32, 64, 128, 256}; loads are masked, so e.g. D = 40 runs the 64 instantiation. 0 = unsupported.
constexpr int cross_attention_fwd_head_dim_instantiation(int64_t head_dim) {
  return head_dim <= 0 ? 0
         : head_dim <= 32 ? 32
         : head_dim <= 64 ? 64
         : head_dim <= 128 ? 128
         : head_dim <= 256 ? 256
                           : 0;
}

/// Query rows owned by each warp in the preferred fp32 tile. Each lane keeps `rows × Dv/32` fp32
/// accumulators in registers, so wide value heads get fewer rows to stay clear of register spills.
constexpr int cross_attention_fwd_rows_per_warp(int head_dim_v_instantiation) {
  return head_dim_v_instantiation >= 256 ? 4 : 8;
}

/// Row stride (in floats) of the K tile in shared memory. The +4 makes each 8-lane phase of a float4
/// load hit distinct banks when lane j reads row j, without breaking 16-byte alignment.
constexpr int cross_attention_fwd_k_tile_stride(int head_dim_instantiation) {
  return head_dim_instantiation + 4;
}

/// Dynamic shared memory of one fp32 block with `rows_per_warp` query rows per warp: the fp32 Q tile,
/// K tile and V tile. Tiles are stored in fp32 (converted once on load) because every K/V element is
/// read by all rows of the block.
constexpr std::size_t cross_attention_fwd_smem_bytes(int head_dim_instantiation, int head_dim_v_instantiation,
                                                     int rows_per_warp) {
  return sizeof(float) *
         (static_cast<std::size_t>(kCrossAttentionFwdWarps * rows_per_warp) * head_dim_instantiation +
          static_cast<std::size_t>(kCrossAttentionFwdBlockN) * cross_attention_fwd_k_tile_stride(head_dim_instantiation) +
          static_cast<std::size_t>(kCrossAttentionFwdBlockN) * head_dim_v_instantiation);
}

/// The fp32 tiles of (D, Dv) as common/smem_limits.h chooses among them: fewer rows per warp shrink
/// the Q tile (K and V are shared by the block). Only D = 256 with Dv ≤ 128 compiles a fall-back,
/// for 64 KiB devices; D = Dv = 256 does not fit those with any number of rows.
struct CrossAttentionFwdSmemOfRows {
  int d, dv;
  constexpr std::size_t operator()(int rows_per_warp) const { return cross_attention_fwd_smem_bytes(d, dv, rows_per_warp); }
};
constexpr bool cross_attention_fwd_rows_compiled(int head_dim_instantiation, int head_dim_v_instantiation, int rows) {
  return tile_is_compiled(cross_attention_fwd_rows_per_warp(head_dim_v_instantiation), rows,
                          CrossAttentionFwdSmemOfRows{head_dim_instantiation, head_dim_v_instantiation});
}

// Tensor-core (WMMA) forward, used for fp16 and bf16. One instantiation per head dimension serves
// both D and Dv (the larger one, rounded up to {32, 64, 128, 256}; loads zero-pad the rest): that
// keeps the instantiation count at 2 dtypes × 4 instead of 2 × 16, at the price of some wasted MMAs
// when D and Dv differ a lot. Each warp owns 16 query rows (one fragment row); the block shares K/V.
// The preferred tile has 4 warps; where it does not fit, fewer warps shrink everything but K and V.
constexpr int kCrossAttentionWmmaWarps = 4;
constexpr int kCrossAttentionWmmaBlockN = 32;

/// Row strides (elements) of the 16-bit tiles and the fp32 tiles. WMMA needs a multiple of 16 bytes;
/// the extra 16 bytes shift consecutive rows by four banks, so fragment loads do not all hit one bank.
constexpr int cross_attention_wmma_half_stride(int cols) { return cols + 8; }
constexpr int cross_attention_wmma_float_stride(int cols) { return cols + 4; }

/// Dynamic shared memory of the WMMA kernel with `warps` warps (16·warps query rows): Q, K, V and P as
/// 16-bit tiles; the scores S, the output accumulator O, per-row rescale factors and per-key biases
/// (0 or −inf) in fp32. Every section is a multiple of 32 bytes, the alignment load/store_matrix_sync need.
constexpr std::size_t cross_attention_wmma_smem_bytes(int dim, int warps) {
  const std::size_t block_m = 16 * static_cast<std::size_t>(warps);
  return 2 * (block_m + 2 * kCrossAttentionWmmaBlockN) * cross_attention_wmma_half_stride(dim) +
         2 * block_m * cross_attention_wmma_half_stride(kCrossAttentionWmmaBlockN) +
         4 * block_m *
             (cross_attention_wmma_float_stride(kCrossAttentionWmmaBlockN) + cross_attention_wmma_float_stride(dim) + 1) +
         4 * static_cast<std::size_t>(kCrossAttentionWmmaBlockN);
}

/// The WMMA tiles of a head-dim bucket (common/smem_limits.h): 4 warps, and the fall-backs 128 → 2
/// warps (64 KiB), 256 → 2 warps (96 KiB) and 1 warp (64 KiB).
struct CrossAttentionWmmaSmemOfWarps {
  int dim;
  constexpr std::size_t operator()(int warps) const { return cross_attention_wmma_smem_bytes(dim, warps); }
};
constexpr bool cross_attention_wmma_warps_compiled(int dim, int warps) {
  return tile_is_compiled(kCrossAttentionWmmaWarps, warps, CrossAttentionWmmaSmemOfWarps{dim});
}

/// What the launcher will do for one problem shape.
struct CrossAttentionLaunchPlan {
  bool supported = false;      ///< false: `error` says why, nothing is launched
  const char* error = nullptr;  ///< static string, set when !supported
  bool empty = false;           ///< B·H·M = 0: supported, but there is nothing to launch
  LaunchDims grid;              ///< 1-D: blockIdx.x = (b·H + h)·num_m_tiles + m_tile
  LaunchDims block;
  std::size_t shared_memory_bytes = 0;
  int head_dim_instantiation = 0;    ///< compiled D (≥ D)
  int head_dim_v_instantiation = 0;  ///< compiled Dv (≥ Dv)
  int block_m = 0;                   ///< query rows per block (= warps · rows_per_warp)
  int block_n = 0;                   ///< keys per shared-memory tile
  int warps = 0;                     ///< warps per block (block.x / 32)
  int rows_per_warp = 0;             ///< query rows per warp (16 for the WMMA kernel)
  /// fp16/bf16: the WMMA kernel, with head_dim_instantiation == head_dim_v_instantiation; fp32: SIMT.
  bool tensor_cores = false;
  SmemShortfall smem;  ///< set when no compiled tile fits the device
};

/// The reason the attention kernels cannot take this dtype or these sizes, or nullptr.
inline const char* attention_dtype_and_size_error(ScalarType dtype, int64_t B, int64_t H, int64_t M, int64_t N) {
  if (!is_attention_dtype(dtype)) return kAttentionDtypeError;
  return B < 0 || H < 0 || M < 0 || N < 0 ? "negative size" : nullptr;
}

/// Plans the launch of the forward kernel for q [B,H,M,D], k [B,H,N,D], v [B,H,N,Dv] on a device whose
/// opt-in shared memory per block is `smem_limit` bytes and whose compute capability is
/// `compute_capability` (major·10 + minor; common/device_limits.h): the largest compiled tile that
/// fits, or unsupported with `smem` saying what the smallest one needs, or with the reason the
/// device's tensor cores cannot take the dtype (bf16 below 8.0).
///
/// `pair_masks` (causal or attn_mask, AttentionMaskLayout::has_pair_masks()): the fp32 kernel's
/// pair-mask instantiations exist for one head-dim bucket only (D and Dv rounded up to the larger,
/// as the tensor-core kernel always does), which keeps them at 4 (+1 fall-back) instead of 16 (+3).
inline CrossAttentionLaunchPlan plan_cross_attention_fwd(int64_t B, int64_t H, int64_t M, int64_t N, int64_t D,
                                                         int64_t Dv, ScalarType dtype, std::size_t smem_limit,
                                                         int compute_capability, bool pair_masks = false) {
  CrossAttentionLaunchPlan plan;
  plan.error = attention_dtype_and_size_error(dtype, B, H, M, N);
  if (plan.error != nullptr) return plan;
  plan.head_dim_instantiation = cross_attention_fwd_head_dim_instantiation(D);
  plan.head_dim_v_instantiation = cross_attention_fwd_head_dim_instantiation(Dv);
  if (plan.head_dim_instantiation == 0 || plan.head_dim_v_instantiation == 0) {
    plan.error = "head dimension D and Dv must be in [1, 256] for the CUDA kernel";
    return plan;
  }
  plan.tensor_cores = dtype != ScalarType::kFloat32;
  plan.block_n = plan.tensor_cores ? kCrossAttentionWmmaBlockN : kCrossAttentionFwdBlockN;
  if (plan.tensor_cores || pair_masks) {
    const int dim = plan.head_dim_instantiation > plan.head_dim_v_instantiation ? plan.head_dim_instantiation
                                                                                : plan.head_dim_v_instantiation;
    plan.head_dim_instantiation = plan.head_dim_v_instantiation = dim;
  }
  if (plan.tensor_cores) {
    plan.error = tensor_core_dtype_error(dtype, compute_capability);
    if (plan.error != nullptr) return plan;
    const int dim = plan.head_dim_instantiation;
    const CrossAttentionWmmaSmemOfWarps bytes{dim};
    plan.warps = compiled_tile_within(kCrossAttentionWmmaWarps, smem_limit, bytes);
    if (plan.warps == 0) {
      plan.error = smem_shortfall(plan.smem, "fp16/bf16 tensor-core forward",
                                  bytes(smallest_compiled_tile(kCrossAttentionWmmaWarps, bytes)), smem_limit);
      return plan;
    }
    plan.rows_per_warp = 16;
    plan.shared_memory_bytes = bytes(plan.warps);
  } else {
    const CrossAttentionFwdSmemOfRows bytes{plan.head_dim_instantiation, plan.head_dim_v_instantiation};
    const int preferred = cross_attention_fwd_rows_per_warp(plan.head_dim_v_instantiation);
    plan.rows_per_warp = compiled_tile_within(preferred, smem_limit, bytes);
    if (plan.rows_per_warp == 0) {
      plan.error = smem_shortfall(plan.smem, "fp32 forward", bytes(smallest_compiled_tile(preferred, bytes)),
                                  smem_limit);
      return plan;
    }
    plan.warps = kCrossAttentionFwdWarps;
    plan.shared_memory_bytes = bytes(plan.rows_per_warp);
  }
  plan.block_m = plan.warps * plan.rows_per_warp;
  plan.block.x = static_cast<unsigned int>(plan.warps * 32);

  if (B == 0 || H == 0 || M == 0) {
    plan.supported = true;
    plan.empty = true;
    plan.grid.x = 0;
    return plan;
  }
  // Divide before multiplying so that absurd sizes are rejected instead of overflowing int64.
  const int64_t m_tiles = (M + plan.block_m - 1) / plan.block_m;
  if (H > kMaxGridX / B || m_tiles > kMaxGridX / (B * H)) {
    plan.error = "too many blocks: B*H*ceil(M/block_m) exceeds the CUDA grid limit";
    return plan;
  }
  plan.grid.x = static_cast<unsigned int>(B * H * m_tiles);
  plan.supported = true;
  return plan;
}

}  // namespace cuda
}  // namespace attn_ext
