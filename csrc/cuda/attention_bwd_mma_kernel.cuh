// Device code of the FlashAttention-2-style backward (fp16/bf16, fp32 accumulation, sm_80 and later): the
// dK/dV and dQ kernels after the Δ pre-pass of attention_bwd_kernel.cuh (attention_bwd_mma_plan.h).
//
// The two kernels are one kernel seen from two sides, as the WMMA backward: a block owns 64 rows (keys
// for dK/dV, queries for dQ) of a pair of tiles A, B (K, V or Q, dO) and streams the other side's pair
// A', B' (Q, dO or K, V) through shared memory. Warp w owns rows 16w..16w+15 and, per streamed tile,
// keeps in registers (common/mma_sm80.cuh's fragments):
//  1. X = A·A'ᵀ and dX = B·B'ᵀ with mma.sync, both operands by ldmatrix: the scores S and dP = dO·Vᵀ,
//     transposed in the dK/dV kernel (rows = keys);
//  2. per element, P = exp(scale·s + bias − lse) and dS = P∘(dP − Δ + dlse) (attn_ext/online_softmax.h's
//     softmax_probability / score_gradient: empty rows and padded keys give 0, NaN rows NaN), in place;
//  3. the accumulators from P and dS reused as A operands without leaving registers: dK/dV kernel
//     dV += Pᵀ·dO and dK += dSᵀ·Q, dQ kernel dQ += dS·K, the streamed rows by ldmatrix.trans.
// Masked pairs carry the −0.0 marker; a masked tile whose streamed rows hold inf/NaN accumulates by exact
// scalar FMAs that skip it (common/mma_tiles.cuh), as the forward does. Padded keys load as zero rows
// and get zero gradients. The causal rule bounds the streamed loop as the WMMA backward does.
//
// Included by attention_bwd_mma.cu (nvcc) and csrc/tests/cuda_attention_bwd_mma_emulation_test.cpp (g++).
#pragma once

#include <cstdint>

#include "attn_ext/online_softmax.h"
#include "attention_bwd.cuh"
#include "attention_bwd_mma_plan.h"
#include "attention_bwd_side.cuh"
#include "common/dtypes.cuh"
#include "common/mma_sm80.cuh"
#include "common/mma_tiles.cuh"
#include "common/pair_mask.cuh"

namespace attn_ext {
namespace cuda {
namespace detail {

/// Compile-time geometry and shared-memory offsets (bytes); the launcher static_asserts kBytes against
/// mma_bwd_smem_bytes().
template <int kDim>
struct MmaBwdLayout {
  static constexpr int kWarps = kMmaBwdWarps, kThreads = 32 * kWarps, kOwn = kMmaBwdOwnRows;
  static constexpr int kOther = mma_bwd_streamed_rows(kDim), kStride = mma_bwd_smem_stride(kDim);
  static constexpr int kChunks = kDim / 8, kNB = kOther / 8, kDB = kDim / 8;
  static constexpr std::size_t kOwnA = 0;
  static constexpr std::size_t kOwnB = kOwnA + 2 * static_cast<std::size_t>(kOwn) * kStride;
  static constexpr std::size_t kOtherA = kOwnB + 2 * static_cast<std::size_t>(kOwn) * kStride;
  static constexpr std::size_t kOtherB = kOtherA + 2 * static_cast<std::size_t>(kOther) * kStride;
  static constexpr std::size_t kStats = kOtherB + 2 * static_cast<std::size_t>(kOther) * kStride;
  static constexpr std::size_t kBytes = kStats + 4 * 4 * static_cast<std::size_t>(kOwn);  // lse | Δ | dlse | bias
  static_assert(kDim % 16 == 0 && kOther % 16 == 0 && kOther <= kOwn, "MMA tiles are 16 wide");
};

/// Issues the cp.async of one side's pair of tiles: (K, V) of key/value head `head` from key r0, or
/// (Q, dO) of query head `head` from query r0, of the sequence `seq`. Padded keys load as zero rows.
template <typename scalar_t, int kDim, int kRows>
__device__ __forceinline__ void load_pair_async(char* smem, std::size_t a_offset, std::size_t b_offset,
                                                const CrossAttentionBwdParams& p, bool keys, const SequenceView& seq,
                                                int64_t head, int64_t r0, int valid) {
  using L = MmaBwdLayout<kDim>;
  const BwdSide<scalar_t> side = bwd_side<scalar_t>(p, keys, seq, head, r0);
  load_tile_async<L::kThreads, kRows, L::kChunks, L::kStride>(reinterpret_cast<scalar_t*>(smem + a_offset), side.first,
                                                              side.first_stride, valid, static_cast<int>(p.D),
                                                              side.padding);
  load_tile_async<L::kThreads, kRows, L::kChunks, L::kStride>(reinterpret_cast<scalar_t*>(smem + b_offset), side.second,
                                                              side.second_stride, valid, static_cast<int>(p.Dv),
                                                              side.padding);
}

/// lse | Δ | dlse of `count` query rows from row `row0` of [B·H·M] (a packed call's [H·total_q]; −inf | 0 | 0
/// past `valid`), or the biases (0, −inf for padding or past N) of `count` keys from key n0 of the sequence.
__device__ __forceinline__ void load_query_rows(float* stats, const CrossAttentionBwdParams& p, int64_t row0,
                                                int count, int valid) {
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const bool ok = i < valid;
    stats[i] = ok ? p.lse[row0 + i] : negative_infinity<float>();
    stats[kMmaBwdOwnRows + i] = ok ? p.delta[row0 + i] : 0.0f;
    stats[2 * kMmaBwdOwnRows + i] = ok ? p.grad_lse[row0 + i] : 0.0f;
  }
}
__device__ __forceinline__ void load_key_rows(float* bias, const CrossAttentionBwdParams& p, const SequenceView& seq,
                                              int64_t n0, int count, int valid) {
  const uint8_t* mask =
      p.key_padding_mask == nullptr ? nullptr : p.key_padding_mask + seq.b * p.mask_stride_b + seq.k0;
  for (int j = threadIdx.x; j < count; j += blockDim.x) {
    bias[j] = j < valid && (mask == nullptr || mask[n0 + j] == 0) ? 0.0f : negative_infinity<float>();
  }
}

/// X[16 × kOther] = own rows (16 from `own_lane`'s row) · other rowsᵀ, for one warp (like Q·Kᵀ).
template <typename scalar_t, int kDim>
__device__ __forceinline__ void warp_scores(MmaC (&x)[MmaBwdLayout<kDim>::kNB], uint32_t own_lane,
                                            uint32_t other_lane) {
  using L = MmaBwdLayout<kDim>;
#pragma unroll
  for (int nb = 0; nb < L::kNB; ++nb) x[nb] = MmaC{{0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
  for (int kk = 0; kk < kDim / 16; ++kk) {
    MmaA a;
    ldmatrix_x4(a.r, own_lane + 2 * kk * 16);
#pragma unroll
    for (int nb = 0; nb < L::kNB; nb += 2) {
      uint32_t b[4];
      ldmatrix_x4(b, other_lane + 2 * (8 * nb * L::kStride + kk * 16));
      mma_m16n8k16<scalar_t>(x[nb], a, MmaB{{b[0], b[1]}});
      mma_m16n8k16<scalar_t>(x[nb + 1], a, MmaB{{b[2], b[3]}});
    }
  }
}

/// acc[16 × kDim] += coef[16 × kOther] · rows[kOther × kDim] (rows row-major in shared memory at
/// `rows_lane`, this lane's ldmatrix.trans address), coef from registers. Warp-collective.
template <typename scalar_t, int kDim>
__device__ __forceinline__ void warp_acc(MmaC (&acc)[MmaBwdLayout<kDim>::kDB], const MmaC (&coef)[MmaBwdLayout<kDim>::kNB],
                                         uint32_t rows_lane) {
  using L = MmaBwdLayout<kDim>;
#pragma unroll
  for (int ks = 0; ks < L::kOther / 16; ++ks) {
    const MmaA a = c_pair_as_a<scalar_t>(coef[2 * ks], coef[2 * ks + 1]);
#pragma unroll
    for (int db = 0; db < L::kDB; db += 2) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, rows_lane + 2 * (16 * ks * L::kStride + 8 * db));
      mma_m16n8k16<scalar_t>(acc[db], a, MmaB{{b[0], b[1]}});
      mma_m16n8k16<scalar_t>(acc[db + 1], a, MmaB{{b[2], b[3]}});
    }
  }
}

/// One block of the kernel below. kKeyTile: the dK/dV kernel, else dQ.
template <typename scalar_t, int kDim, bool kKeyTile, bool kPairMasks>
__device__ __forceinline__ void attention_bwd_mma_block(const CrossAttentionBwdParams& p) {
  using L = MmaBwdLayout<kDim>;
  constexpr int kOwn = L::kOwn, kOther = L::kOther, kNB = L::kNB, kDB = L::kDB;
  extern __shared__ float4 smem_raw[];
  char* smem = reinterpret_cast<char*>(smem_raw);
  float* stats = reinterpret_cast<float*>(smem + L::kStats);  // lse | Δ | dlse, kOwn rows each
  float* bias = stats + 3 * kOwn;

  // Blocks: (batch, key/value head, key tile) for dK/dV, looping over the head's kv_group query heads
  // (GQA); (batch, query head, query tile) for dQ. 32-bit divisions (the plan bounds the grid).
  // A packed call's grid counts the longest sequence's tiles; the blocks past their sequence's end return.
  const unsigned int own_tiles = static_cast<unsigned int>(((kKeyTile ? p.N : p.M) + kOwn - 1) / kOwn);
  const unsigned int group = static_cast<unsigned int>(p.kv_group);
  const unsigned int heads = static_cast<unsigned int>(p.H) / (kKeyTile ? group : 1u);
  const unsigned int bh = blockIdx.x / own_tiles;
  const int64_t b = bh / heads, own_head = bh % heads;
  const int64_t kv_head = kKeyTile ? own_head : static_cast<unsigned int>(own_head) / group;
  const int64_t o0 = static_cast<int64_t>(blockIdx.x % own_tiles) * kOwn;
  const SequenceView seq = sequence_view(p, b, p.M, p.N);
  const int64_t own_count = kKeyTile ? seq.N : seq.M, other_count = kKeyTile ? seq.M : seq.N;
  if (o0 >= own_count) return;  // block-uniform: before any barrier
  const int own_valid = static_cast<int>(own_count - o0 < kOwn ? own_count - o0 : kOwn);

  load_pair_async<scalar_t, kDim, kOwn>(smem, L::kOwnA, L::kOwnB, p, kKeyTile, seq, own_head, o0, own_valid);
  cp_async_commit();
  if (kKeyTile) {
    load_key_rows(bias, p, seq, o0, kOwn, own_valid);
  } else {
    load_query_rows(stats, p, seq.query_row(p.H, own_head) + o0, kOwn, own_valid);
  }

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  const int row0 = 16 * warp;
  const auto tile_lane = [&](std::size_t offset, int row, int col) {
    return shared_address(reinterpret_cast<const scalar_t*>(smem + offset) + row * L::kStride + col);
  };
  // ldmatrix addresses: A operands of the owned rows; B operands of the streamed rows (non-trans, as K
  // in Q·Kᵀ) and of the streamed rows transposed (as V in P·V).
  const uint32_t own_a = tile_lane(L::kOwnA, row0 + lane % 16, (lane / 16) * 8);
  const uint32_t own_b = tile_lane(L::kOwnB, row0 + lane % 16, (lane / 16) * 8);
  const int b_row = (lane / 16) * 8 + lane % 8, b_col = ((lane / 8) % 2) * 8;
  const int t_row = ((lane / 8) % 2) * 8 + lane % 8, t_col = (lane / 16) * 8;
  const uint32_t other_a = tile_lane(L::kOtherA, b_row, b_col), other_b = tile_lane(L::kOtherB, b_row, b_col);
  const uint32_t other_a_t = tile_lane(L::kOtherA, t_row, t_col), other_b_t = tile_lane(L::kOtherB, t_row, t_col);
  const scalar_t* other_a_rows = reinterpret_cast<const scalar_t*>(smem + L::kOtherA);
  const scalar_t* other_b_rows = reinterpret_cast<const scalar_t*>(smem + L::kOtherB);

  MmaC acc_a[kDB], acc_b[kDB];  // dK and dV, or dQ (acc_b unused)
#pragma unroll
  for (int db = 0; db < kDB; ++db) acc_a[db] = acc_b[db] = MmaC{{0.0f, 0.0f, 0.0f, 0.0f}};

  // The causal rule and the band: the streamed tiles that hold the queries seeing the block's keys (dK/dV) or
  // the keys its queries see (dQ); the tiles outside are masked for every pair.
  const IndexRange streamed = !kPairMasks ? IndexRange{0, other_count}
                              : kKeyTile  ? band_queries(p, o0, o0 + kOwn, other_count, seq.shift)
                                          : band_keys(p, o0, o0 + kOwn, other_count, seq.shift);
  const int64_t t_begin = streamed.begin / kOther * kOther, t_end = streamed.end;
#pragma unroll 1
  for (int64_t gq = 0; gq < (kKeyTile ? p.kv_group : 1); ++gq) {
    const int64_t q_head = kKeyTile ? kv_head * p.kv_group + gq : own_head;
    const int64_t q_row = seq.query_row(p.H, q_head);  // row 0 of the query head's lse, Δ and dlse
#pragma unroll 1
    for (int64_t t0 = t_begin; t0 < t_end; t0 += kOther) {
      const int other_valid = static_cast<int>(other_count - t0 < kOther ? other_count - t0 : kOther);
      __syncthreads();  // every warp is done with the previous streamed tile and its rows' data
      load_pair_async<scalar_t, kDim, kOther>(smem, L::kOtherA, L::kOtherB, p, !kKeyTile, seq,
                                              kKeyTile ? q_head : kv_head, t0, other_valid);
      cp_async_commit();
      if (kKeyTile) {
        load_query_rows(stats, p, q_row + t0, kOther, other_valid);
      } else {
        load_key_rows(bias, p, seq, t0, kOther, other_valid);
      }
      cp_async_wait<0>();
      bool exact = false;
      if (kPairMasks) {
        const bool mine = tile_has_nonfinite<L::kThreads, kOther, L::kChunks, L::kStride>(other_a_rows) ||
                          tile_has_nonfinite<L::kThreads, kOther, L::kChunks, L::kStride>(other_b_rows);
        exact = __syncthreads_or(mine) != 0;
      } else {
        __syncthreads();
      }

      MmaC x[kNB], dx[kNB];
      warp_scores<scalar_t, kDim>(x, own_a, other_a);
      warp_scores<scalar_t, kDim>(dx, own_b, other_b);
      const PairMaskHead<scalar_t> pair_mask =
          kPairMasks ? pair_mask_head<scalar_t>(p, b, q_head, seq.shift) : PairMaskHead<scalar_t>{};
      const int64_t m0 = kKeyTile ? t0 : o0, n0 = kKeyTile ? o0 : t0;
      const int m_valid = kKeyTile ? other_valid : own_valid;
#pragma unroll
      for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int own_row = row0 + g + 8 * (i / 2), col = 8 * nb + 2 * t + i % 2;
          const int query = kKeyTile ? col : own_row, key = kKeyTile ? own_row : col;
          float key_bias = bias[key];
          bool masked = false;
          if (kPairMasks) {
            key_bias = key_bias == 0.0f && query < m_valid ? pair_mask.bias(m0 + query, n0 + key)
                                                          : negative_infinity<float>();
            masked = is_negative_infinity(key_bias);
          }
          const float dot = x[nb].r[i];
          float slope = 1.0f;
          const float prob = softmax_probability(kPairMasks ? pair_mask.score(dot, p.scale, key_bias, &slope)
                                                            : fmaf(dot, p.scale, key_bias), stats[query]);
          const float ds = score_gradient(prob, dx[nb].r[i], stats[kOwn + query], stats[2 * kOwn + query]) * slope;
          x[nb].r[i] = kPairMasks && masked ? masked_coefficient() : prob;
          dx[nb].r[i] = kPairMasks && masked ? masked_coefficient() : ds;
        }
      }
      if (!exact) {
        if (kKeyTile) {
          warp_acc<scalar_t, kDim>(acc_b, x, other_b_t);   // dV += Pᵀ·dO
          warp_acc<scalar_t, kDim>(acc_a, dx, other_a_t);  // dK += dSᵀ·Q
        } else {
          warp_acc<scalar_t, kDim>(acc_a, dx, other_a_t);  // dQ += dS·K
        }
      } else {
        if (kKeyTile) exact_tile_acc<scalar_t>(acc_b, x, other_b_rows, L::kStride);
        exact_tile_acc<scalar_t>(acc_a, dx, other_a_rows, L::kStride);
      }
    }
  }
  cp_async_wait<0>();  // the owned tiles' group when nothing was streamed
  __syncthreads();     // the biases, when nothing was streamed, were written by other threads

  // Each warp writes its rows: dK and dQ scaled, padded keys' gradients 0 (even when a NaN query row put
  // 0 · NaN into their accumulators). Pairs of columns as one 32-bit store (D and Dv are multiples of 8).
  const int64_t base = (kKeyTile ? seq.key_row(heads, own_head) : seq.query_row(p.H, own_head)) + o0;
  scalar_t* grad_a = static_cast<scalar_t*>(kKeyTile ? p.grad_k : p.grad_q) + base * p.D;
  scalar_t* grad_b = static_cast<scalar_t*>(p.grad_v) + base * p.Dv;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row0 + g + 8 * h;
    if (r >= own_valid) continue;
    const bool padded = kKeyTile && is_negative_infinity(bias[r]);
#pragma unroll
    for (int db = 0; db < kDB; ++db) {
      const int c = 8 * db + 2 * t;
      const float a0 = padded ? 0.0f : p.scale * acc_a[db].r[2 * h], a1 = padded ? 0.0f : p.scale * acc_a[db].r[2 * h + 1];
      if (c < p.D) *reinterpret_cast<uint32_t*>(grad_a + r * p.D + c) = pack_pair<scalar_t>(a0, a1);
      if (kKeyTile && c < p.Dv) {
        const float b0 = padded ? 0.0f : acc_b[db].r[2 * h], b1 = padded ? 0.0f : acc_b[db].r[2 * h + 1];
        *reinterpret_cast<uint32_t*>(grad_b + r * p.Dv + c) = pack_pair<scalar_t>(b0, b1);
      }
    }
  }
}

/// kKeyTile: the dK/dV kernel (grid.x = B·(H / kv_group)·ceil(N / 64)); else dQ (B·H·ceil(M / 64)).
/// Launched with MmaBwdLayout<kDim>::kThreads threads and kBytes of dynamic shared memory; requires the
/// mma eligibility of the launcher. kPairMasks: the attention_bwd instantiation (causal / attn_mask).
template <typename scalar_t, int kDim, bool kKeyTile, bool kPairMasks>
__global__ void __launch_bounds__(MmaBwdLayout<kDim>::kThreads, 2) attention_bwd_mma_kernel(const CrossAttentionBwdParams p) {
  if constexpr (kMmaSm80) {
    attention_bwd_mma_block<scalar_t, kDim, kKeyTile, kPairMasks>(p);
  } else {
    __trap();  // below sm_80: the launcher takes the WMMA kernels there
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
