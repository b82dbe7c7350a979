// Device code of the CUDA cross-attention backward on CUDA cores (fp32 arithmetic); the work split
// is described in attention_bwd_plan.h. The launcher uses the Δ pre-pass for every dtype and
// these gradient kernels for fp32 inputs (fp16/bf16 take attention_bwd_wmma_kernel.cuh).
//
// Both gradient kernels go through the same kTile×kTile tile step (16, or 8 where the device's shared
// memory needs it: attention_bwd_plan.h): with the query tile (Q, dO, lse, Δ,
// dlse) and the key tile (K, V, per-key bias 0/−inf) in shared memory, bwd_tile_scores() writes
// P = exp(scale·q·k + bias − lse) and dS = P∘(dO·v − Δ + dlse) (the header's softmax_probability
// and score_gradient, so empty rows give P = 0 and zero gradients, NaN rows NaN; padded keys are
// loaded as zeros and their gradients stored as zeros). The dK/dV kernel then adds
// Pᵀ dO and scale·dSᵀ Q to its key tile's accumulators; the dQ kernel adds scale·dS K to its query
// tile's. Each output element is owned by one block and summed in a fixed order: deterministic.
//
// Included by attention_bwd.cu (nvcc) and csrc/tests/cuda_attention_bwd_emulation_test.cpp.
#pragma once

#include <cstdint>

#include "attn_ext/online_softmax.h"
#include "common/dtypes.cuh"
#include "common/pair_mask.cuh"
#include "common/warp.cuh"
#include "attention_bwd.cuh"

namespace attn_ext {
namespace cuda {
namespace detail {

/// Loads `rows` rows of `cols` elements as fp32 into a tile with row stride cols + 1, zero past
/// `rows_valid` and in rows flagged by `padding` (null, or a flag per row: padded keys are never
/// read, so dP = dO·v and dQ += dS·K stay 0 for them whatever they hold; the pad column is never read).
/// `nonfinite` (null, or this thread's flag) as in load_tile (common/tile.cuh).
template <typename scalar_t>
__device__ __forceinline__ void load_rows(float* __restrict__ dst, const scalar_t* __restrict__ src,
                                          int64_t row_stride, int rows, int rows_valid, int cols,
                                          const uint8_t* __restrict__ padding = nullptr, bool* nonfinite = nullptr) {
  for (int idx = threadIdx.x; idx < rows * cols; idx += kCrossAttentionBwdThreads) {
    const int r = idx / cols, c = idx % cols;
    const bool read = r < rows_valid && (padding == nullptr || padding[r] == 0);
    const float value = read ? to_float(src[r * row_stride + c]) : 0.0f;
    if (nonfinite != nullptr && !isfinite(value)) *nonfinite = true;
    dst[r * (cols + 1) + c] = value;
  }
}

/// The per-row statistics of a query tile: lse (−inf past M, so those rows get P = 0), Δ and dlse.
template <int kTile>
__device__ __forceinline__ void load_row_stats(float* smem, const CrossAttentionBwdSmem& s,
                                               const CrossAttentionBwdParams& p, int64_t row0, int rows_valid) {
  for (int i = threadIdx.x; i < kTile; i += kCrossAttentionBwdThreads) {
    const bool valid = i < rows_valid;
    smem[s.lse + i] = valid ? p.lse[row0 + i] : negative_infinity<float>();
    smem[s.delta + i] = valid ? p.delta[row0 + i] : 0.0f;
    smem[s.dlse + i] = valid ? p.grad_lse[row0 + i] : 0.0f;
  }
}

/// The per-key bias of a key tile: 0 for a valid key, −inf for padding and for rows past N.
template <int kTile>
__device__ __forceinline__ void load_key_bias(float* smem, const CrossAttentionBwdSmem& s, const uint8_t* mask,
                                              int64_t n0, int rows_valid) {
  for (int j = threadIdx.x; j < kTile; j += kCrossAttentionBwdThreads) {
    const bool valid = j < rows_valid && (mask == nullptr || mask[n0 + j] == 0);
    smem[s.bias + j] = valid ? 0.0f : negative_infinity<float>();
  }
}

/// Where the current (query tile, key tile) pair sits, for the pair masks: the tiles' first query
/// and key, the query tile's valid rows, and the (batch, query head)'s masks.
template <typename scalar_t>
struct BwdPairTile {
  PairMaskHead<scalar_t> mask;
  int64_t m0, n0;
  int m_valid;
};

/// P and dS of the current (query tile, key tile) pair, [kTile][kTile] row-major in shared memory.
/// kPairMasks: a pair masked by causal / attn_mask (or padding) gets the −0.0 marker in both
/// (common/pair_mask.cuh), whatever its rows hold.
template <int kTile, bool kPairMasks = false, typename scalar_t = float>
__device__ __forceinline__ void bwd_tile_scores(float* smem, const CrossAttentionBwdSmem& s, int D, int Dv,
                                                float scale, const BwdPairTile<scalar_t>* pair = nullptr) {
  constexpr int BN = kTile;
  for (int e = threadIdx.x; e < kTile * BN; e += kCrossAttentionBwdThreads) {
    const int i = e / BN, j = e % BN;
    const float* q = smem + s.q + i * (D + 1);
    const float* k = smem + s.k + j * (D + 1);
    const float* dout = smem + s.dout + i * (Dv + 1);
    const float* v = smem + s.v + j * (Dv + 1);
    float dot = 0.0f, grad_prob = 0.0f;
    for (int c = 0; c < D; ++c) dot = fmaf(q[c], k[c], dot);
    for (int c = 0; c < Dv; ++c) grad_prob = fmaf(dout[c], v[c], grad_prob);
    if (kPairMasks) {
      const bool key_valid = smem[s.bias + j] == 0.0f;
      const float bias = key_valid && i < pair->m_valid ? pair->mask.bias(pair->m0 + i, pair->n0 + j)
                                                         : negative_infinity<float>();
      const bool masked = is_negative_infinity(bias);
      float slope;
      const float prob = softmax_probability(pair->mask.score(dot, scale, bias, &slope), smem[s.lse + i]);
      const float ds = score_gradient(prob, grad_prob, smem[s.delta + i], smem[s.dlse + i]) * slope;
      smem[s.p + e] = masked ? masked_coefficient() : prob;
      smem[s.ds + e] = masked ? masked_coefficient() : allowed_coefficient<float>(ds);
    } else {
      const float prob = softmax_probability(fmaf(dot, scale, smem[s.bias + j]), smem[s.lse + i]);
      smem[s.p + e] = prob;
      smem[s.ds + e] = score_gradient(prob, grad_prob, smem[s.delta + i], smem[s.dlse + i]);
    }
  }
}

/// acc[r][c] += mul · Σ_t coef(t, r) · rows[t][c] over the kTile rows of the other tile: coef is P
/// or dS, read transposed (dK/dV) or not (dQ) through the strides. `exact`: `rows` holds inf or NaN,
/// and masked pairs (coefficient −0.0) must not touch it (common/pair_mask.cuh).
template <int kTile>
__device__ __forceinline__ void accumulate_tile(float* __restrict__ acc, int acc_rows, int cols,
                                                const float* __restrict__ coef, int coef_stride_r, int coef_stride_t,
                                                const float* __restrict__ rows, float mul, bool exact = false) {
  for (int e = threadIdx.x; e < acc_rows * cols; e += kCrossAttentionBwdThreads) {
    const int r = e / cols, c = e % cols;
    float sum = 0.0f;
    if (exact) {
      for (int t = 0; t < kTile; ++t)
        sum = masked_fma(coef[r * coef_stride_r + t * coef_stride_t], rows[t * (cols + 1) + c], sum);
    } else {
#pragma unroll
      for (int t = 0; t < kTile; ++t)
        sum = fmaf(coef[r * coef_stride_r + t * coef_stride_t], rows[t * (cols + 1) + c], sum);
    }
    acc[e] = fmaf(mul, sum, acc[e]);
  }
}

/// Δ_i = dO_i·o_i, one warp per row of [B·H·M] (a packed call: [1·H·total_q]); warps past the end still take
/// part in the shuffles.
template <typename scalar_t>
__global__ void __launch_bounds__(kCrossAttentionBwdThreads) cross_attention_bwd_delta_kernel(
    const CrossAttentionBwdParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kCrossAttentionDeltaRowsPerBlock + threadIdx.x / 32;
  const int64_t batches = p.packed() ? 1 : p.B, rows = p.packed() ? p.total_q : p.M;
  const bool valid = row < batches * p.H * rows;
  float partial = 0.0f;
  if (valid) {
    const int64_t bh = row / rows, m = row % rows, b = bh / p.H, h = bh % p.H;
    const scalar_t* o = static_cast<const scalar_t*>(p.out) + b * p.out_stride_b + h * p.out_stride_h + m * p.out_stride_m;
    const scalar_t* g =
        static_cast<const scalar_t*>(p.grad_out) + b * p.dout_stride_b + h * p.dout_stride_h + m * p.dout_stride_m;
    for (int64_t c = lane; c < p.Dv; c += 32) partial = fmaf(to_float(o[c]), to_float(g[c]), partial);
  }
  const float delta = warp_sum(partial);
  if (valid && lane == 0) p.delta[row] = delta;
}

/// Loads query tile `m0` of query head h of the sequence `seq` (common/packed_sequences.h): Q, dO and the row
/// statistics.
template <typename scalar_t, int kTile>
__device__ __forceinline__ void load_query_tile(float* smem, const CrossAttentionBwdSmem& s,
                                                const CrossAttentionBwdParams& p, const SequenceView& seq, int64_t h,
                                                int64_t m0, bool* nonfinite = nullptr) {
  const int rows = static_cast<int>(seq.M - m0 < kTile ? seq.M - m0 : kTile);
  const int D = static_cast<int>(p.D), Dv = static_cast<int>(p.Dv);
  const int64_t m = seq.q0 + m0;
  load_rows(smem + s.q, static_cast<const scalar_t*>(p.q) + seq.b * p.q_stride_b + h * p.q_stride_h + m * p.q_stride_m,
            p.q_stride_m, kTile, rows, D, nullptr, nonfinite);
  load_rows(smem + s.dout,
            static_cast<const scalar_t*>(p.grad_out) + seq.b * p.dout_stride_b + h * p.dout_stride_h +
                m * p.dout_stride_m,
            p.dout_stride_m, kTile, rows, Dv, nullptr, nonfinite);
  load_row_stats<kTile>(smem, s, p, seq.query_row(p.H, h) + m0, rows);
}

/// Loads key tile `n0` of the sequence's key/value head `kv_head`: K, V and the key biases.
template <typename scalar_t, int kTile>
__device__ __forceinline__ void load_key_tile(float* smem, const CrossAttentionBwdSmem& s,
                                              const CrossAttentionBwdParams& p, const SequenceView& seq,
                                              int64_t kv_head, int64_t n0, bool* nonfinite = nullptr) {
  const int rows = static_cast<int>(seq.N - n0 < kTile ? seq.N - n0 : kTile);
  const int D = static_cast<int>(p.D), Dv = static_cast<int>(p.Dv);
  const uint8_t* mask = p.key_padding_mask == nullptr ? nullptr : p.key_padding_mask + seq.b * p.mask_stride_b + seq.k0;
  const uint8_t* tile_padding = mask == nullptr ? nullptr : mask + n0;
  const int64_t n = seq.k0 + n0;
  load_rows(smem + s.k,
            static_cast<const scalar_t*>(p.k) + seq.b * p.k_stride_b + kv_head * p.k_stride_h + n * p.k_stride_n,
            p.k_stride_n, kTile, rows, D, tile_padding, nonfinite);
  load_rows(smem + s.v,
            static_cast<const scalar_t*>(p.v) + seq.b * p.v_stride_b + kv_head * p.v_stride_h + n * p.v_stride_n,
            p.v_stride_n, kTile, rows, Dv, tile_padding, nonfinite);
  load_key_bias<kTile>(smem, s, mask, n0, rows);
}

/// Writes the first `rows` rows of a [kTile][cols] fp32 accumulator to a contiguous output; rows whose
/// `bias` (null, or the key tile's biases) is −inf are padded keys and get 0, even when a NaN query
/// row put 0 · NaN into their accumulators.
template <typename scalar_t>
__device__ __forceinline__ void store_rows(scalar_t* __restrict__ dst, const float* __restrict__ acc, int rows,
                                           int cols, const float* __restrict__ bias = nullptr) {
  for (int e = threadIdx.x; e < rows * cols; e += kCrossAttentionBwdThreads) {
    const bool padded = bias != nullptr && is_negative_infinity(bias[e / cols]);
    dst[e] = from_float<scalar_t>(padded ? 0.0f : acc[e]);
  }
}

/// One step of either gradient kernel: once every thread is done with the previous step's tiles,
/// loads the moving tile (query tile `m0` of query head h for dK/dV, key tile `n0` of key/value head
/// kv_head for dQ, of batch entry or packed sequence b seen as `seq`) and computes P and dS. Returns
/// (kPairMasks only) whether the moving tile, the one the products then read, holds inf or NaN.
template <typename scalar_t, int kTile, bool kKeyTileKernel, bool kPairMasks>
__device__ __forceinline__ bool bwd_step(float* smem, const CrossAttentionBwdSmem& s, const CrossAttentionBwdParams& p,
                                         const SequenceView& seq, int64_t b, int64_t h, int64_t kv_head, int64_t m0,
                                         int64_t n0) {
  __syncthreads();
  bool nonfinite = false;
  bool* check = kPairMasks ? &nonfinite : nullptr;
  if (kKeyTileKernel) {
    load_query_tile<scalar_t, kTile>(smem, s, p, seq, h, m0, check);
  } else {
    load_key_tile<scalar_t, kTile>(smem, s, p, seq, kv_head, n0, check);
  }
  if (kPairMasks) {
    nonfinite = __syncthreads_or(nonfinite) != 0;
    const BwdPairTile<scalar_t> pair{pair_mask_head<scalar_t>(p, b, h, seq.shift), m0, n0,
                                     static_cast<int>(seq.M - m0 < kTile ? seq.M - m0 : kTile)};
    bwd_tile_scores<kTile, true>(smem, s, static_cast<int>(p.D), static_cast<int>(p.Dv), p.scale, &pair);
  } else {
    __syncthreads();
    bwd_tile_scores<kTile>(smem, s, static_cast<int>(p.D), static_cast<int>(p.Dv), p.scale);
  }
  __syncthreads();
  return nonfinite;
}

/// dK and dV of one key tile of one key/value head, summed over its query heads (GQA: kv_group of
/// them, in this block: no atomics); grid.x = B·(H / kv_group)·ceil(N/kTile), key tile fastest.
/// kPairMasks: the attention_bwd instantiation (causal / attn_mask; a causal block starts at the
/// first query tile that sees its keys).
///
/// The minimum of 8 blocks per SM (≤ 64 registers, the whole register file at 8 × 128 threads, about
/// the occupancy the tiles' shared memory allows anyway): with the key/value-head loop, ptxas (CUDA 13)
/// squeezed the 8-row instantiation to 32 registers and spilled 192 bytes without it.
template <typename scalar_t, int kTile, bool kPairMasks = false>
__global__ void __launch_bounds__(kCrossAttentionBwdThreads, 8) cross_attention_bwd_dkdv_kernel(
    const CrossAttentionBwdParams p) {
  constexpr int BM = kTile, BN = kTile;
  extern __shared__ float4 smem_raw[];
  float* smem = reinterpret_cast<float*>(smem_raw);
  const int D = static_cast<int>(p.D), Dv = static_cast<int>(p.Dv);
  const CrossAttentionBwdSmem s = cross_attention_bwd_smem(D, Dv, true, kTile);
  const unsigned int n_tiles = static_cast<unsigned int>((p.N + BN - 1) / BN);
  // 32-bit divisions: the 64-bit division subroutine costs registers (see the forward kernel).
  const unsigned int kv_heads = static_cast<unsigned int>(p.H) / static_cast<unsigned int>(p.kv_group);
  const unsigned int bkv = blockIdx.x / n_tiles;
  const int64_t b = bkv / kv_heads, kv_head = bkv % kv_heads;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x % n_tiles) * BN;
  const SequenceView seq = sequence_view(p, b, p.M, p.N);
  if (n0 >= seq.N) return;  // a packed sequence shorter than the longest (block-uniform: before any barrier)

  load_key_tile<scalar_t, kTile>(smem, s, p, seq, kv_head, n0);
  for (int e = threadIdx.x; e < BN * D; e += kCrossAttentionBwdThreads) smem[s.acc_a + e] = 0.0f;
  for (int e = threadIdx.x; e < BN * Dv; e += kCrossAttentionBwdThreads) smem[s.acc_b + e] = 0.0f;
  // The query tiles the causal rule and the band leave to the block's keys (all without pair masks).
  const IndexRange queries = kPairMasks ? band_queries(p, n0, n0 + BN, seq.M, seq.shift) : IndexRange{0, seq.M};
  for (int64_t g = 0; g < p.kv_group; ++g) {
    const int64_t h = kv_head * p.kv_group + g;
    for (int64_t m0 = queries.begin / BM * BM; m0 < queries.end; m0 += BM) {
      const bool exact = bwd_step<scalar_t, kTile, true, kPairMasks>(smem, s, p, seq, b, h, kv_head, m0, n0);
      accumulate_tile<kTile>(smem + s.acc_b, BN, Dv, smem + s.p, 1, BN, smem + s.dout, 1.0f, exact);   // dV += Pᵀ dO
      accumulate_tile<kTile>(smem + s.acc_a, BN, D, smem + s.ds, 1, BN, smem + s.q, p.scale, exact);  // dK += scale·dSᵀ Q
    }
  }
  // Each thread stores the accumulator elements it alone updated: no barrier needed.
  const int rows = static_cast<int>(seq.N - n0 < BN ? seq.N - n0 : BN);
  const int64_t key = seq.key_row(kv_heads, kv_head) + n0;
  store_rows(static_cast<scalar_t*>(p.grad_k) + key * p.D, smem + s.acc_a, rows, D, smem + s.bias);
  store_rows(static_cast<scalar_t*>(p.grad_v) + key * p.Dv, smem + s.acc_b, rows, Dv, smem + s.bias);
}

/// dQ of one query tile; grid.x = B·H·ceil(M/kTile), query tile fastest. kPairMasks as above (a
/// causal block stops at the last key tile its rows see). Minimum of 8 blocks per SM as above: without
/// it ptxas spilled 152 bytes in the sm_80 16-row instantiation.
template <typename scalar_t, int kTile, bool kPairMasks = false>
__global__ void __launch_bounds__(kCrossAttentionBwdThreads, 8) cross_attention_bwd_dq_kernel(
    const CrossAttentionBwdParams p) {
  constexpr int BM = kTile, BN = kTile;
  extern __shared__ float4 smem_raw[];
  float* smem = reinterpret_cast<float*>(smem_raw);
  const int D = static_cast<int>(p.D);
  const CrossAttentionBwdSmem s = cross_attention_bwd_smem(D, static_cast<int>(p.Dv), false, kTile);
  const unsigned int m_tiles = static_cast<unsigned int>((p.M + BM - 1) / BM);
  const int64_t bh = blockIdx.x / m_tiles, m0 = static_cast<int64_t>(blockIdx.x % m_tiles) * BM;
  const int64_t b = bh / p.H, h = bh % p.H;
  const int64_t kv_head = static_cast<unsigned int>(h) / static_cast<unsigned int>(p.kv_group);
  const SequenceView seq = sequence_view(p, b, p.M, p.N);
  if (m0 >= seq.M) return;  // a packed sequence shorter than the longest (block-uniform: before any barrier)

  load_query_tile<scalar_t, kTile>(smem, s, p, seq, h, m0);
  for (int e = threadIdx.x; e < BM * D; e += kCrossAttentionBwdThreads) smem[s.acc_a + e] = 0.0f;
  // The key tiles the causal rule and the band leave to the block's rows (all without pair masks).
  const IndexRange keys = kPairMasks ? band_keys(p, m0, m0 + BM, seq.N, seq.shift) : IndexRange{0, seq.N};
  for (int64_t n0 = keys.begin / BN * BN; n0 < keys.end; n0 += BN) {
    const bool exact = bwd_step<scalar_t, kTile, false, kPairMasks>(smem, s, p, seq, b, h, kv_head, m0, n0);
    accumulate_tile<kTile>(smem + s.acc_a, BM, D, smem + s.ds, BN, 1, smem + s.k, p.scale, exact);  // dQ += scale·dS K
  }
  const int rows = static_cast<int>(seq.M - m0 < BM ? seq.M - m0 : BM);
  store_rows(static_cast<scalar_t*>(p.grad_q) + (seq.query_row(p.H, h) + m0) * p.D, smem + s.acc_a, rows, D);
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
