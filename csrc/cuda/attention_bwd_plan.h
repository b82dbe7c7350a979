// Launch geometry and shared-memory layout of the CUDA cross-attention backward (docs/spec.md §1 backward),
// as plain C++17 (host code and the CPU unit tests compute exactly what the launcher uses).
//
// Three kernels, all deterministic (no atomics):
//  * Δ pre-pass: Δ_i = dO_i·o_i, one warp per query row;
//  * dK/dV: one block per key tile, looping over the query tiles; P is recomputed from the saved
//    LSE and dS = P∘(dO·vᵀ − Δ + dlse);
//  * dQ: one block per query tile, looping over the key tiles (recomputing P and dS once more).
// fp32 runs SIMT kernels with runtime D and Dv (two instantiations each, 16×16 and 8×8 tiles),
// per-block accumulators in shared memory. fp16/bf16 run the tensor-core kernels described below.
#pragma once

#include <cstddef>
#include <cstdint>

#include "attn_ext/macros.h"
#include "attention_fwd_plan.h"

namespace attn_ext {
namespace cuda {

constexpr int kCrossAttentionBwdThreads = 128;
constexpr int kCrossAttentionDeltaRowsPerBlock = kCrossAttentionBwdThreads / 32;  ///< one warp per row

/// Query rows per query tile and keys per key tile of the fp32 kernels. D and Dv are runtime, so both
/// tiles are compiled: 16, and 8 for wide heads on devices where 16 does not fit (D = Dv = 256 needs
/// 98.5 KiB with 16, over sm_70's 96 KiB; sm_75's 64 KiB takes 16 up to D + Dv = 328).
constexpr int kCrossAttentionBwdTile = 16;
constexpr int kCrossAttentionBwdSmallTile = 8;

/// Offsets (in floats) of one fp32 backward block's shared memory with `tile`-row tiles. Q/dO/K/V
/// tiles are stored with an odd row stride (cols + 1) so that the threads scoring one query row
/// against the tile's keys read different banks. `acc_a` holds dK (key-tile kernel) or dQ (query-tile
/// kernel), `acc_b` dV.
struct CrossAttentionBwdSmem {
  int q, dout, k, v, p, ds, lse, delta, dlse, bias, acc_a, acc_b, floats;
};

ATTN_EXT_HOST_DEVICE CrossAttentionBwdSmem cross_attention_bwd_smem(int D, int Dv, bool key_tile_kernel, int tile) {
  const int BM = tile, BN = tile;
  CrossAttentionBwdSmem s{};
  s.q = 0;
  s.dout = s.q + BM * (D + 1);
  s.k = s.dout + BM * (Dv + 1);
  s.v = s.k + BN * (D + 1);
  s.p = s.v + BN * (Dv + 1);
  s.ds = s.p + BM * BN;
  s.lse = s.ds + BM * BN;
  s.delta = s.lse + BM;
  s.dlse = s.delta + BM;
  s.bias = s.dlse + BM;
  s.acc_a = s.bias + BN;
  s.acc_b = s.acc_a + (key_tile_kernel ? BN : BM) * D;
  s.floats = s.acc_b + (key_tile_kernel ? BN * Dv : 0);
  return s;
}

/// Bytes of the larger of the two fp32 gradient kernels (dK/dV: it holds two accumulators).
inline std::size_t cross_attention_bwd_simt_bytes(int64_t D, int64_t Dv, int tile) {
  return sizeof(float) *
         static_cast<std::size_t>(cross_attention_bwd_smem(static_cast<int>(D), static_cast<int>(Dv), true, tile).floats);
}

// Tensor-core (WMMA) backward for fp16/bf16: one head-dim bucket (the larger of D and Dv, rounded up
// to {32, 64, 128, 256}, zero-padded) per instantiation, as in the forward. Each warp owns 16 rows
// of the block's "own" tile (keys in the dK/dV kernel, queries in the dQ kernel) and the block
// streams the other side in tiles of 32; P and dS are rounded to 16 bits for the second products,
// as FlashAttention does. The preferred tile has 4 warps, 2 for the widest bucket so that it fits
// sm_80; fewer warps shrink every section but the streamed tile (common/smem_limits.h).
constexpr int kCrossAttentionBwdWmmaOther = 32;
constexpr int cross_attention_bwd_wmma_preferred_warps(int dim) { return dim <= 128 ? 4 : 2; }

/// Byte offsets of the WMMA backward kernels' shared memory (see attention_bwd_wmma_kernel.cuh).
struct CrossAttentionBwdWmmaSmem {
  std::size_t own, other, scores, coef, acc, stats, bias, bytes;
  int half_stride, score_stride, coef_stride, acc_stride;
};

constexpr CrossAttentionBwdWmmaSmem cross_attention_bwd_wmma_smem(int dim, int warps, bool key_tile_kernel) {
  const int own = 16 * warps, other = kCrossAttentionBwdWmmaOther;
  CrossAttentionBwdWmmaSmem s{};
  s.half_stride = dim + 8;     // 16-bit tiles: rows a multiple of 16 bytes, shifted by 4 banks
  s.score_stride = other + 4;  // fp32 S and dP
  s.coef_stride = other + 8;   // 16-bit P and dS
  s.acc_stride = dim + 4;      // fp32 accumulators
  s.own = 0;                                                            // 2 × [own][dim] 16-bit
  s.other = s.own + 2u * 2u * static_cast<std::size_t>(own) * s.half_stride;       // 2 × [other][dim] 16-bit
  s.scores = s.other + 2u * 2u * static_cast<std::size_t>(other) * s.half_stride;  // S, dP
  s.coef = s.scores + 2u * 4u * static_cast<std::size_t>(own) * s.score_stride;    // P, dS
  s.acc = s.coef + 2u * 2u * static_cast<std::size_t>(own) * s.coef_stride;        // dK, dV or dQ
  s.stats = s.acc + (key_tile_kernel ? 2u : 1u) * 4u * static_cast<std::size_t>(own) * s.acc_stride;
  s.bias = s.stats + 3u * 4u * 64u;  // lse, Δ, dlse of up to 64 query rows
  s.bytes = s.bias + 4u * 64u;       // key biases of up to 64 keys
  return s;
}

/// The WMMA tiles of a bucket as common/smem_limits.h chooses among them, by the dK/dV kernel's bytes
/// (the larger: two accumulators); both kernels of a plan take the same warp count. Compiled: 32 → 4;
/// 64 → 4, 2; 128 → 4, 2, 1; 256 → 2, 1 (none fits 64 KiB).
struct CrossAttentionBwdWmmaSmemOfWarps {
  int dim;
  constexpr std::size_t operator()(int warps) const { return cross_attention_bwd_wmma_smem(dim, warps, true).bytes; }
};
constexpr bool cross_attention_bwd_wmma_warps_compiled(int dim, int warps) {
  return tile_is_compiled(cross_attention_bwd_wmma_preferred_warps(dim), warps, CrossAttentionBwdWmmaSmemOfWarps{dim});
}

/// Blocks of the Δ pre-pass over `rows` query rows (B·H·M; a packed call's H·total_q), one warp per row.
constexpr unsigned int cross_attention_bwd_delta_blocks(int64_t rows) {
  return static_cast<unsigned int>((rows + kCrossAttentionDeltaRowsPerBlock - 1) / kCrossAttentionDeltaRowsPerBlock);
}

struct CrossAttentionBwdPlan {
  bool supported = false;
  const char* error = nullptr;  ///< static string, set when !supported
  LaunchDims block;             ///< the same for the two gradient kernels
  LaunchDims delta_grid;        ///< x = ceil(B·H·M / rows per block); 0 = skip
  LaunchDims dkdv_grid;         ///< x = B·H·ceil(N / own keys), key tile fastest; 0 = skip
  LaunchDims dq_grid;           ///< x = B·H·ceil(M / own queries), query tile fastest; 0 = skip
  std::size_t dkdv_smem_bytes = 0;
  std::size_t dq_smem_bytes = 0;
  /// fp16/bf16: the WMMA kernels for dK/dV and dQ with head-dim bucket `dim` and `warps` warps
  /// (block.x = 32·warps; the Δ pre-pass keeps delta_block). fp32: the SIMT kernels with `tile`-row tiles.
  bool tensor_cores = false;
  int dim = 0;
  int warps = 0;
  int tile = 0;
  LaunchDims delta_block;
  SmemShortfall smem;  ///< set when no compiled tile fits the device
};

/// Plans the backward of q [B,H,M,D], k [B,H,N,D], v [B,H,N,Dv] on a device with `smem_limit` bytes
/// of opt-in shared memory per block and compute capability `compute_capability` (major·10 + minor;
/// bf16 is refused below 8.0, as in the forward). An empty M still launches dK/dV (which write zeros),
/// an empty N still launches dQ. `kv_group` query heads share each key/value head (GQA): the dK/dV
/// kernel has a block per key tile of each of the H / kv_group key/value heads.
inline CrossAttentionBwdPlan plan_cross_attention_bwd(int64_t B, int64_t H, int64_t M, int64_t N, int64_t D,
                                                      int64_t Dv, ScalarType dtype, std::size_t smem_limit,
                                                      int compute_capability, int64_t kv_group = 1) {
  CrossAttentionBwdPlan plan;
  plan.error = attention_dtype_and_size_error(dtype, B, H, M, N);
  if (plan.error != nullptr) return plan;
  if (kv_group < 1 || H % kv_group != 0) {
    plan.error = "the query heads must be a multiple of the key/value heads";
    return plan;
  }
  if (D < 1 || D > kCrossAttentionFwdMaxHeadDim || Dv < 1 || Dv > kCrossAttentionFwdMaxHeadDim) {
    plan.error = "head dimension D and Dv must be in [1, 256] for the CUDA kernel";
    return plan;
  }
  plan.tensor_cores = dtype != ScalarType::kFloat32;
  int own = 0;  // rows of the tile a gradient block owns (keys for dK/dV, queries for dQ)
  if (plan.tensor_cores) {
    plan.error = tensor_core_dtype_error(dtype, compute_capability);
    if (plan.error != nullptr) return plan;
    plan.dim = cross_attention_fwd_head_dim_instantiation(D > Dv ? D : Dv);
    const CrossAttentionBwdWmmaSmemOfWarps bytes{plan.dim};
    const int preferred = cross_attention_bwd_wmma_preferred_warps(plan.dim);
    plan.warps = compiled_tile_within(preferred, smem_limit, bytes);
    if (plan.warps == 0) {
      plan.error = smem_shortfall(plan.smem, "fp16/bf16 tensor-core backward (dK/dV kernel)",
                                  bytes(smallest_compiled_tile(preferred, bytes)), smem_limit);
      return plan;
    }
    own = 16 * plan.warps;
    plan.dkdv_smem_bytes = cross_attention_bwd_wmma_smem(plan.dim, plan.warps, true).bytes;
    plan.dq_smem_bytes = cross_attention_bwd_wmma_smem(plan.dim, plan.warps, false).bytes;
  } else {
    plan.tile = cross_attention_bwd_simt_bytes(D, Dv, kCrossAttentionBwdTile) <= smem_limit ? kCrossAttentionBwdTile
                : cross_attention_bwd_simt_bytes(D, Dv, kCrossAttentionBwdSmallTile) <= smem_limit
                    ? kCrossAttentionBwdSmallTile
                    : 0;
    if (plan.tile == 0) {
      plan.error = smem_shortfall(plan.smem, "fp32 backward (dK/dV kernel)",
                                  cross_attention_bwd_simt_bytes(D, Dv, kCrossAttentionBwdSmallTile), smem_limit);
      return plan;
    }
    own = plan.tile;
    const int d = static_cast<int>(D), dv = static_cast<int>(Dv);
    plan.dkdv_smem_bytes = sizeof(float) * static_cast<std::size_t>(cross_attention_bwd_smem(d, dv, true, own).floats);
    plan.dq_smem_bytes = sizeof(float) * static_cast<std::size_t>(cross_attention_bwd_smem(d, dv, false, own).floats);
  }
  const int64_t m_tiles = (M + own - 1) / own, n_tiles = (N + own - 1) / own;
  const int64_t tiles = m_tiles > n_tiles ? m_tiles : n_tiles;
  if (B > 0 && H > 0 && (H > kMaxGridX / B || tiles > kMaxGridX / (B * H) || M > kMaxGridX / (B * H))) {
    plan.error = "too many blocks: B*H*tiles exceeds the CUDA grid limit";
    return plan;
  }
  plan.delta_block.x = kCrossAttentionBwdThreads;
  plan.block.x = static_cast<unsigned int>(plan.tensor_cores ? 32 * plan.warps : kCrossAttentionBwdThreads);
  plan.delta_grid.x = cross_attention_bwd_delta_blocks(B * H * M);
  plan.dkdv_grid.x = static_cast<unsigned int>(B * (H / kv_group) * n_tiles);
  plan.dq_grid.x = static_cast<unsigned int>(B * H * m_tiles);
  plan.supported = true;
  return plan;
}

}  // namespace cuda
}  // namespace attn_ext
