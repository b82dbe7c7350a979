// Device code of the FlashAttention-2-style forward: fp16/bf16 inputs, fp32 accumulation, sm_80 and later.
//
// One block = block_m query rows of one (batch, head), 4 warps; warp w owns rows 16·kMTiles·w onwards
// and keeps everything of its rows in registers (common/mma_sm80.cuh for the fragment layouts):
//  * the output accumulator O (kMTiles × dim/8 MMA C fragments), the running max and sum of 2·kMTiles rows;
//  * the score tile S = Q·Kᵀ of one key tile (kMTiles × block_n/8 C fragments), turned in place into the
//    probabilities P, which become the A operand of P·V without leaving registers (a C fragment pair of
//    two adjacent 8-key blocks is exactly one 16-key A fragment).
// Shared memory holds Q (read by ldmatrix at every key tile), one K tile and one V tile, filled by
// 16-byte cp.async: V_j loads while Q·K_jᵀ runs, K_{j+1} while the softmax and P·V_j run. Key tiles
// are visited in two loops: first the tiles that no pair mask touches (every tile without a causal
// rule or attn_mask; below the diagonal with the causal rule), then the masked ones (the diagonal
// tiles, or every tile with an attn_mask), which read the pair masks (common/pair_mask.cuh).
//
// Exactness rules, as the other attention kernels (docs/cross_attention.md "NaN, inf and empty rows"):
// padded keys and rows past N are loaded as zeros and their scores selected as −inf, so neither
// their K nor V values can reach a result; a masked pair's score is selected as −inf and its
// probability marked −0.0. A masked pair's probability times a non-finite V element would still give
// NaN in the MMA, so masked tiles check their V tile (a block-wide OR) and, when it holds inf or NaN,
// accumulate that tile by exact scalar FMAs that skip marked pairs (rare: it needs inf/NaN values).
// Empty rows end with out = 0 and lse = −inf; NaN scores propagate (attn_ext/online_softmax.h).
//
// Included by attention_fwd_mma.cu (nvcc) and csrc/tests/cuda_fwd_emulation_test.cpp (g++, with the
// emulator's mma_sm80_emulation.h behind common/mma_sm80.cuh).
#pragma once

#include <cstdint>

#include "attn_ext/online_softmax.h"
#include "attention_fwd.cuh"
#include "attention_fwd_kernel.cuh"  // fwd_block: the (batch, head, row tile) of a block
#include "attention_fwd_mma_plan.h"
#include "common/dtypes.cuh"
#include "common/mma_sm80.cuh"
#include "common/mma_tiles.cuh"
#include "common/pair_mask.cuh"

namespace attn_ext {
namespace cuda {
namespace detail {

/// Compile-time geometry and shared-memory offsets (bytes) of one instantiation; the launcher
/// static_asserts kBytes against mma_fwd_smem_bytes() so the host plan and the kernel agree.
template <int kDim>
struct MmaFwdLayout {
  static constexpr MmaFwdTile kTile = mma_fwd_tile(kDim);
  static constexpr int kWarps = kTile.warps, kMTiles = kTile.m_tiles, kBlockN = kTile.block_n;
  static constexpr int kThreads = 32 * kWarps, kBlockM = kTile.block_m();
  static constexpr int kStride = mma_fwd_smem_stride(kDim);  // elements
  static constexpr int kChunks = kDim / 8;                   // 16-byte pieces per row
  static constexpr std::size_t kQ = 0;
  static constexpr std::size_t kK = kQ + 2 * static_cast<std::size_t>(kBlockM) * kStride;
  static constexpr std::size_t kV = kK + 2 * static_cast<std::size_t>(kBlockN) * kStride;
  static constexpr std::size_t kBias = kV + 2 * static_cast<std::size_t>(kBlockN) * kStride;
  static constexpr std::size_t kBytes = kBias + 4 * 2 * static_cast<std::size_t>(kBlockN);
  static_assert(kDim % 16 == 0 && kBlockN % 16 == 0, "MMA tiles are 16 wide");
  static_assert((2 * kStride) % 16 == 0 && kK % 16 == 0 && kV % 16 == 0, "cp.async and ldmatrix need 16-byte rows");
};

/// The per-warp state of a block: its rows' accumulators and softmax statistics.
template <int kDim, int kMTiles>
struct MmaFwdWarpState {
  MmaC o[kMTiles][kDim / 8];
  OnlineSoftmaxRow<float> row[kMTiles][2];  // rows g and g + 8 of each 16-row tile (partial sums per lane)
};

/// One key tile for one warp: S = Q·Kᵀ, masks, online softmax, O = factor·O + P·V. kMasked: the tile
/// reads the pair masks (the second loop). Contains the tile's three barriers: K landed, K free for the
/// next tile, V landed. Tiles hold kBlockN keys but the last, `last_rows` (up to the end of the block's keys,
/// band_keys: a key past it is no row's, and loads as padding): one 32-bit count instead of holding the sequence's
/// 64-bit key count in registers through the loop.
template <typename scalar_t, int kDim, bool kMasked>
__device__ __forceinline__ void mma_fwd_key_tile(MmaFwdWarpState<kDim, MmaFwdLayout<kDim>::kMTiles>& st,
                                                 const CrossAttentionFwdParams& p, const FwdBlock<scalar_t>& blk,
                                                 char* smem, int64_t n0, int tile, int64_t num_tiles, int last_rows) {
  using L = MmaFwdLayout<kDim>;
  constexpr int kMTiles = L::kMTiles, kBlockN = L::kBlockN, kNB = kBlockN / 8;
  const scalar_t* q_tile = reinterpret_cast<const scalar_t*>(smem + L::kQ);
  scalar_t* k_tile = reinterpret_cast<scalar_t*>(smem + L::kK);
  scalar_t* v_tile = reinterpret_cast<scalar_t*>(smem + L::kV);
  float* bias = reinterpret_cast<float*>(smem + L::kBias) + (tile & 1) * kBlockN;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;
  const int row0 = warp * 16 * kMTiles;

  // K_tile (and its bias) landed, issued by the previous tile or the prologue; every warp is past the
  // previous P·V, so V may be overwritten.
  cp_async_wait<0>();
  __syncthreads();
  const int n_rows = tile + 1 < num_tiles ? kBlockN : last_rows;
  const uint8_t* padding = blk.mask == nullptr ? nullptr : blk.mask + n0;
  load_tile_async<L::kThreads, kBlockN, L::kChunks, L::kStride>(v_tile, blk.v + n0 * p.v_stride_n, p.v_stride_n,
                                                                n_rows, static_cast<int>(p.Dv), padding);
  cp_async_commit();

  // 1. S = Q·Kᵀ (unscaled). Each B fragment pair (two 8-key blocks) serves kMTiles row tiles.
  MmaC s[kMTiles][kNB];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nb = 0; nb < kNB; ++nb) s[mt][nb] = MmaC{{0.0f, 0.0f, 0.0f, 0.0f}};
  // This lane's ldmatrix row addresses at offset 0; every fragment below adds a compile-time offset.
  const uint32_t q_lane = shared_address(q_tile + (row0 + lane % 16) * L::kStride + (lane / 16) * 8);
  const uint32_t k_lane = shared_address(k_tile + ((lane / 16) * 8 + lane % 8) * L::kStride + ((lane / 8) % 2) * 8);
#pragma unroll
  for (int kk = 0; kk < kDim / 16; ++kk) {
    MmaA a[kMTiles];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) ldmatrix_x4(a[mt].r, q_lane + 2 * (16 * mt * L::kStride + kk * 16));
#pragma unroll
    for (int nb = 0; nb < kNB; nb += 2) {
      uint32_t b[4];  // matrices: keys 8nb.. × d 0-7, d 8-15; keys 8nb+8.. × d 0-7, d 8-15 of this k step
      ldmatrix_x4(b, k_lane + 2 * (8 * nb * L::kStride + kk * 16));
      const MmaB b0{{b[0], b[1]}}, b1{{b[2], b[3]}};
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        mma_m16n8k16<scalar_t>(s[mt][nb], a[mt], b0);
        mma_m16n8k16<scalar_t>(s[mt][nb + 1], a[mt], b1);
      }
    }
  }

  // 2. Scale and mask (selected, never added: see pair_mask.cuh), online softmax per row. The pair
  // masks' pointers are formed here, in the masked tiles only, so they hold no registers elsewhere.
  const PairMaskHead<scalar_t> pair_mask =
      kMasked ? pair_mask_head<scalar_t>(p, blk.b, blk.h, sequence_shift(p, blk.b)) : PairMaskHead<scalar_t>{};
  const int64_t M = kMasked ? sequence_rows(p, blk.b, p.M) : 0;  // asked again: see sequence_rows
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t m = blk.m0 + row0 + 16 * mt + g + 8 * h;
      const PairMaskRow<scalar_t> rules = kMasked && m < M ? pair_mask.row(m, n0) : PairMaskRow<scalar_t>{};
      float block_max = negative_infinity<float>();
#pragma unroll
      for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = 8 * nb + 2 * t + e;
          float score = bias[j] == 0.0f ? s[mt][nb].r[2 * h + e] * p.scale : negative_infinity<float>();
          if (kMasked) {
            const float pair = bias[j] == 0.0f && m < M ? rules.bias(j) : negative_infinity<float>();
            score = masked_score(pair_mask.capped(score), pair);
          }
          s[mt][nb].r[2 * h + e] = score;
          block_max = fmaxf(block_max, score);
        }
      }
      block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 1));
      block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 2));
      const float factor = online_softmax_advance(st.row[mt][h], block_max);
      const float shift = online_softmax_shift(st.row[mt][h]);
      float sum = 0.0f;
#pragma unroll
      for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float score = s[mt][nb].r[2 * h + e];
          const float prob = math_exp(score - shift);
          sum += prob;
          // A masked pair carries the marker; its exp(−inf) = 0 would too, but a pair masked while the
          // row is still empty (shift 0) must not be told apart from an allowed zero by luck.
          s[mt][nb].r[2 * h + e] = kMasked && is_negative_infinity(score) ? masked_coefficient() : prob;
        }
      }
      st.row[mt][h].sum += sum;
#pragma unroll
      for (int db = 0; db < kDim / 8; ++db) {
        st.o[mt][db].r[2 * h] *= factor;
        st.o[mt][db].r[2 * h + 1] *= factor;
      }
    }
  }

  // Every warp is done with K_tile (the barrier also orders the softmax's bias reads before the
  // next-but-one tile's bias writes): the next tile loads while P·V runs.
  __syncthreads();
  if (tile + 1 < num_tiles) {
    const int64_t n1 = n0 + kBlockN;
    const int rows1 = tile + 2 < num_tiles ? kBlockN : last_rows;
    const uint8_t* padding1 = blk.mask == nullptr ? nullptr : blk.mask + n1;
    load_tile_async<L::kThreads, kBlockN, L::kChunks, L::kStride>(k_tile, blk.k + n1 * p.k_stride_n, p.k_stride_n,
                                                                  rows1, static_cast<int>(p.D), padding1);
    float* bias1 = reinterpret_cast<float*>(smem + L::kBias) + ((tile + 1) & 1) * kBlockN;
    for (int j = threadIdx.x; j < kBlockN; j += L::kThreads) {
      bias1[j] = j < rows1 && (padding1 == nullptr || padding1[j] == 0) ? 0.0f : negative_infinity<float>();
    }
  }
  cp_async_commit();  // an empty group on the last tile keeps the wait counts below uniform

  // V_tile landed (K_{tile+1} may still be in flight).
  cp_async_wait<1>();
  bool exact = false;
  if (kMasked) {
    exact = __syncthreads_or(tile_has_nonfinite<L::kThreads, kBlockN, L::kChunks, L::kStride>(v_tile)) != 0;
  } else {
    __syncthreads();
  }

  // 3. O += P·V, P from registers (two adjacent 8-key C fragments = one 16-key A fragment).
  if (!exact) {
    const uint32_t v_lane = shared_address(v_tile + (((lane / 8) % 2) * 8 + lane % 8) * L::kStride + (lane / 16) * 8);
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks) {
      MmaA a[kMTiles];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) a[mt] = c_pair_as_a<scalar_t>(s[mt][2 * ks], s[mt][2 * ks + 1]);
#pragma unroll
      for (int db = 0; db < kDim / 8; db += 2) {
        uint32_t b[4];  // matrices: keys 16ks.. and 16ks+8.. × d 8db..; the same × d 8db+8..
        ldmatrix_x4_trans(b, v_lane + 2 * (16 * ks * L::kStride + 8 * db));
        const MmaB b0{{b[0], b[1]}}, b1{{b[2], b[3]}};
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_m16n8k16<scalar_t>(st.o[mt][db], a[mt], b0);
          mma_m16n8k16<scalar_t>(st.o[mt][db + 1], a[mt], b1);
        }
      }
    }
  } else {
    // The exact tile (see the file comment).
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) exact_tile_acc<scalar_t>(st.o[mt], s[mt], v_tile, L::kStride);
  }
}

/// One block: prologue loads, the two key-tile loops, the epilogue (normalise, write out and lse).
template <typename scalar_t, int kDim, bool kPairMasks>
__device__ __forceinline__ void attention_fwd_mma_block(const CrossAttentionFwdParams& p) {
  using L = MmaFwdLayout<kDim>;
  constexpr int kMTiles = L::kMTiles, kBlockN = L::kBlockN;
  extern __shared__ float4 smem_raw[];
  char* smem = reinterpret_cast<char*>(smem_raw);

  FwdBlock<scalar_t> blk = fwd_block<scalar_t>(p, L::kBlockM);
  if (blk.m0 >= blk.M) return;  // a packed sequence shorter than the longest (block-uniform: before any barrier)
  if (kPairMasks && p.causal) {
    // Longest row tiles first: under the causal rule the last row tile has the most key tiles, and
    // blocks launch in index order, so the tail of the grid holds the short ones.
    const int64_t m_tiles = (blk.M + L::kBlockM - 1) / L::kBlockM;
    blk.m0 = (m_tiles - 1) * L::kBlockM - blk.m0;
  }
  // The key tiles the causal rule and the band leave to the block's rows, from n_first (all without pair masks).
  const IndexRange keys =
      kPairMasks ? band_keys(p, blk.m0, blk.m0 + L::kBlockM, blk.N, blk.shift) : IndexRange{0, blk.N};
  const int64_t n_first = keys.begin / kBlockN * kBlockN;
  const int64_t num_tiles = (keys.end - n_first + kBlockN - 1) / kBlockN;
  const int last_rows = static_cast<int>(keys.end - (n_first + (num_tiles - 1) * kBlockN));  // of the last tile
  // Tiles [0, first_masked) of these need no pair mask: all of them without pair masks; with the top-left
  // causal rule alone, those whose last key n0 + kBlockN − 1 ≤ m0 (every row of the block sees every key);
  // none with an attn_mask, a band or a score modification (every pair is tested).
  int64_t first_masked = num_tiles;
  if (kPairMasks) {
    first_masked = p.every_tile_per_pair() ? 0 : (blk.m0 + 1) / kBlockN;
    first_masked = first_masked < num_tiles ? first_masked : num_tiles;
  }

  // Prologue: Q, the first K tile and its bias, one group.
  const int m_rows = static_cast<int>(blk.M - blk.m0 < L::kBlockM ? blk.M - blk.m0 : L::kBlockM);
  load_tile_async<L::kThreads, L::kBlockM, L::kChunks, L::kStride>(
      reinterpret_cast<scalar_t*>(smem + L::kQ), blk.q + blk.m0 * p.q_stride_m, p.q_stride_m, m_rows,
      static_cast<int>(p.D), static_cast<const uint8_t*>(nullptr));
  if (num_tiles > 0) {
    const int rows0 = num_tiles > 1 ? kBlockN : last_rows;
    const uint8_t* padding0 = blk.mask == nullptr ? nullptr : blk.mask + n_first;
    load_tile_async<L::kThreads, kBlockN, L::kChunks, L::kStride>(reinterpret_cast<scalar_t*>(smem + L::kK),
                                                                  blk.k + n_first * p.k_stride_n, p.k_stride_n, rows0,
                                                                  static_cast<int>(p.D), padding0);
    float* bias0 = reinterpret_cast<float*>(smem + L::kBias);
    for (int j = threadIdx.x; j < kBlockN; j += L::kThreads) {
      bias0[j] = j < rows0 && (padding0 == nullptr || padding0[j] == 0) ? 0.0f : negative_infinity<float>();
    }
  }
  cp_async_commit();

  MmaFwdWarpState<kDim, kMTiles> st;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int db = 0; db < kDim / 8; ++db) st.o[mt][db] = MmaC{{0.0f, 0.0f, 0.0f, 0.0f}};
    st.row[mt][0] = st.row[mt][1] = online_softmax_empty<float>();
  }
#pragma unroll 1
  for (int64_t tile = 0; tile < first_masked; ++tile) {
    mma_fwd_key_tile<scalar_t, kDim, false>(st, p, blk, smem, n_first + tile * kBlockN, static_cast<int>(tile),
                                            num_tiles, last_rows);
  }
  if (kPairMasks) {
#pragma unroll 1
    for (int64_t tile = first_masked; tile < num_tiles; ++tile) {
      mma_fwd_key_tile<scalar_t, kDim, true>(st, p, blk, smem, n_first + tile * kBlockN, static_cast<int>(tile),
                                             num_tiles, last_rows);
    }
  }
  cp_async_wait<0>();  // the prologue's group when there was no key tile; nothing otherwise

  // Epilogue: the quad's partial sums, then out = O / sum (0 for an empty row) and lse per row.
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t out_row = fwd_output_row(p, blk), rows = sequence_rows(p, blk.b, p.M);
  scalar_t* __restrict__ out = static_cast<scalar_t*>(p.out) + out_row * p.Dv;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      OnlineSoftmaxRow<float> row = st.row[mt][h];
      row.sum += __shfl_xor_sync(0xffffffffu, row.sum, 1);
      row.sum += __shfl_xor_sync(0xffffffffu, row.sum, 2);
      const OnlineSoftmaxResult<float> result = online_softmax_finish(row);
      const int64_t m = blk.m0 + warp * 16 * kMTiles + 16 * mt + g + 8 * h;
      if (m >= rows) continue;
      if (t == 0) p.lse[out_row + m] = result.lse;
      scalar_t* out_row = out + m * p.Dv;
#pragma unroll
      for (int db = 0; db < kDim / 8; ++db) {
        const int c = 8 * db + 2 * t;
        if (c < p.Dv) {
          const uint32_t pair = pack_pair<scalar_t>(st.o[mt][db].r[2 * h] * result.inv_sum,
                                                    st.o[mt][db].r[2 * h + 1] * result.inv_sum);
          *reinterpret_cast<uint32_t*>(out_row + c) = pair;  // Dv is a multiple of 8: c, c + 1 < Dv
        }
      }
    }
  }
}

/// Launched with MmaFwdLayout<kDim>::kThreads threads and kBytes of dynamic shared memory over the 1-D
/// grid of fwd_block (row tiles of block_m). Requires mma_fwd_ineligible() == nullptr. kPairMasks: the
/// attention_fwd instantiation (causal / attn_mask).
template <typename scalar_t, int kDim, bool kPairMasks>
__global__ void __launch_bounds__(MmaFwdLayout<kDim>::kThreads, 2) attention_fwd_mma_kernel(const CrossAttentionFwdParams p) {
  if constexpr (kMmaSm80) {
    attention_fwd_mma_block<scalar_t, kDim, kPairMasks>(p);
  } else {
    __trap();  // below sm_80: the launcher takes the WMMA kernel there
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
