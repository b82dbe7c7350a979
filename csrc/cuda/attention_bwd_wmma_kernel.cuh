// Device code of the tensor-core (WMMA) cross-attention backward for fp16/bf16 inputs (fp32
// accumulation; fp16 from sm_70, bf16 from sm_80, see wmma_tiles.cuh); the Δ pre-pass is the SIMT one of attention_bwd_kernel.cuh.
//
// The dK/dV and dQ kernels are the same kernel seen from two sides. A block owns a tile of 16·kWarps
// rows ("own": keys for dK/dV, queries for dQ) and streams the other side in tiles of 32. Warp w,
// owning rows 16w..16w+15, per streamed tile:
//  1. X = own₁·other₁ᵀ and dX = own₂·other₂ᵀ with wmma into fp32 shared memory: S and dP = dO·Vᵀ
//     (transposed in the dK/dV kernel, where own = (K, V) and other = (Q, dO));
//  2. per element, P = exp(scale·s + bias − lse) and dS = P∘(dP − Δ + dlse) (the header's
//     softmax_probability/score_gradient: empty rows and padded keys give 0, NaN rows NaN), rounded
//     to 16 bits; padded keys are loaded as zero rows and their gradients stored as 0;
//  3. acc += coef·other rows with wmma on fp32 accumulators kept in shared memory:
//     dK/dV kernel: dV += Pᵀ dO and dK += dSᵀ Q; dQ kernel: dQ += dS K (scale applied at the end).
// Every output element belongs to one block and one warp: deterministic, no atomics.
// Fragments are used only through load/store/mma/fill, so the emulator's wmma shim runs this too.
#pragma once

#include <cstdint>

#include "attn_ext/online_softmax.h"
#include "common/dtypes.cuh"
#include "common/tile.cuh"
#include "attention_bwd.cuh"
#include "attention_bwd_side.cuh"
#include "wmma_tiles.cuh"

namespace attn_ext {
namespace cuda {
namespace detail {

/// Loads the lse/Δ/dlse of `count` query rows starting at row `row0` of [B·H·M] (a packed call's [H·total_q];
/// −inf/0 past `valid`).
__device__ __forceinline__ void load_query_stats(float* stats, const CrossAttentionBwdParams& p, int64_t row0,
                                                 int count, int valid) {
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const bool ok = i < valid;
    stats[i] = ok ? p.lse[row0 + i] : negative_infinity<float>();
    stats[64 + i] = ok ? p.delta[row0 + i] : 0.0f;
    stats[128 + i] = ok ? p.grad_lse[row0 + i] : 0.0f;
  }
}

/// Loads the biases (0 valid, −inf padding or past N) of `count` keys starting at key n0 of the sequence.
__device__ __forceinline__ void load_key_biases(float* bias, const CrossAttentionBwdParams& p, const SequenceView& seq,
                                                int64_t n0, int count, int valid) {
  const uint8_t* mask =
      p.key_padding_mask == nullptr ? nullptr : p.key_padding_mask + seq.b * p.mask_stride_b + seq.k0;
  for (int j = threadIdx.x; j < count; j += blockDim.x) {
    const bool ok = j < valid && (mask == nullptr || mask[n0 + j] == 0);
    bias[j] = ok ? 0.0f : negative_infinity<float>();
  }
}

/// The two operand tiles of one side: (K, V) at key n0 or (Q, dO) at query m0, zero-padded.
/// h is the query head for (Q, dO) and the key/value head for (K, V); `nonfinite` as in copy_tile.
template <typename scalar_t, int kThreads, int kRows, int kDim>
__device__ __forceinline__ void load_side(scalar_t* tiles, int ld, const CrossAttentionBwdParams& p, bool keys,
                                          const SequenceView& seq, int64_t h, int64_t r0, int valid,
                                          bool* nonfinite = nullptr) {
  static_assert(kRows * kDim >= kThreads, "every thread copies");
  // Padded keys are zero rows, so that dP = dO·vᵀ and dQ += dS·K stay exactly 0 for them.
  const BwdSide<scalar_t> side = bwd_side<scalar_t>(p, keys, seq, h, r0);
  // ld is the layout's half stride, kDim + 8 (checked by the launcher's static_assert).
  copy_tile<kThreads, kRows, kDim, kDim + 8>(tiles, side.first, side.first_stride, valid, static_cast<int>(p.D),
                                             side.padding, nonfinite);
  copy_tile<kThreads, kRows, kDim, kDim + 8>(tiles + kRows * ld, side.second, side.second_stride, valid,
                                             static_cast<int>(p.Dv), side.padding, nonfinite);
}

/// The plan's constants as scalar compile-time members: device code may not call the (host)
/// constexpr functions of the plan header, but may read constants they produced.
template <int kDim, int kWarpCount, bool kKeyTile>
struct BwdWmmaConfig {
  static constexpr int kWarps = kWarpCount;
  static constexpr CrossAttentionBwdWmmaSmem kLayout = cross_attention_bwd_wmma_smem(kDim, kWarpCount, kKeyTile);
  static constexpr std::size_t own = kLayout.own, other = kLayout.other, scores = kLayout.scores,
                               coef = kLayout.coef, acc = kLayout.acc, stats = kLayout.stats, bias = kLayout.bias;
  static constexpr int half_stride = kLayout.half_stride, score_stride = kLayout.score_stride,
                       coef_stride = kLayout.coef_stride, acc_stride = kLayout.acc_stride;
};

/// One block of the kernel below, for the architectures whose WMMA takes scalar_t.
template <typename scalar_t, int kDim, int kWarps, bool kKeyTile, bool kPairMasks>
__device__ __forceinline__ void cross_attention_bwd_wmma_block(const CrossAttentionBwdParams& p) {
  using L = BwdWmmaConfig<kDim, kWarps, kKeyTile>;
  constexpr int kThreads = 32 * L::kWarps;
  constexpr int kOwn = 16 * L::kWarps, kOther = kCrossAttentionBwdWmmaOther;
  static_assert(L::half_stride == kDim + 8, "load_side assumes the layout's stride");
  // No static shared memory: the dynamic buffer is aligned far beyond wmma's 32 bytes (see the forward).
  extern __shared__ float4 smem_raw[];
  char* smem = reinterpret_cast<char*>(smem_raw);
  scalar_t* own = reinterpret_cast<scalar_t*>(smem + L::own);
  scalar_t* other = reinterpret_cast<scalar_t*>(smem + L::other);
  float* scores = reinterpret_cast<float*>(smem + L::scores);  // S then dP, [kOwn][score_stride] each
  scalar_t* coef = reinterpret_cast<scalar_t*>(smem + L::coef);  // P then dS, [kOwn][coef_stride] each
  float* acc = reinterpret_cast<float*>(smem + L::acc);
  float* stats = reinterpret_cast<float*>(smem + L::stats);  // lse | Δ | dlse, 64 query rows each
  float* bias = reinterpret_cast<float*>(smem + L::bias);

  // Blocks: (batch, key/value head, key tile) in the dK/dV kernel, which loops over the head's
  // kv_group query heads (GQA); (batch, query head, query tile) in the dQ kernel.
  // A packed call's grid counts the longest sequence's tiles; the blocks past their sequence's end return.
  const unsigned int own_tiles = static_cast<unsigned int>(((kKeyTile ? p.N : p.M) + kOwn - 1) / kOwn);
  const unsigned int group = static_cast<unsigned int>(p.kv_group);
  const unsigned int heads = static_cast<unsigned int>(p.H) / (kKeyTile ? group : 1u);
  const unsigned int bh = blockIdx.x / own_tiles;  // b·heads + (key/value or query) head
  const int64_t b = bh / heads, own_head = bh % heads;
  const int64_t kv_head = kKeyTile ? own_head : static_cast<unsigned int>(own_head) / group;
  const int64_t o0 = static_cast<int64_t>(blockIdx.x % own_tiles) * kOwn;
  const SequenceView seq = sequence_view(p, b, p.M, p.N);
  const int64_t own_count = kKeyTile ? seq.N : seq.M, other_count = kKeyTile ? seq.M : seq.N;
  if (o0 >= own_count) return;  // block-uniform: before any barrier
  const int own_valid = static_cast<int>(own_count - o0 < kOwn ? own_count - o0 : kOwn);
  const int ld = L::half_stride;

  load_side<scalar_t, kThreads, kOwn, kDim>(own, ld, p, kKeyTile, seq, own_head, o0, own_valid);
  if (kKeyTile) {
    load_key_biases(bias, p, seq, o0, kOwn, own_valid);
  } else {
    load_query_stats(stats, p, seq.query_row(p.H, own_head) + o0, kOwn, own_valid);
  }
  constexpr int kAccs = kKeyTile ? 2 : 1;
  for (int idx = threadIdx.x; idx < kAccs * kOwn * L::acc_stride; idx += kThreads) acc[idx] = 0.0f;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, row0 = 16 * warp;
  float* s_rows = scores + row0 * L::score_stride;
  float* dp_rows = s_rows + kOwn * L::score_stride;
  scalar_t* p_rows = coef + row0 * L::coef_stride;
  scalar_t* ds_rows = p_rows + kOwn * L::coef_stride;
  // The causal rule and the band: the streamed tiles that hold the queries seeing the block's keys (dK/dV) or
  // the keys its queries see (dQ); the tiles outside are masked for every pair.
  const IndexRange streamed = !kPairMasks ? IndexRange{0, other_count}
                              : kKeyTile  ? band_queries(p, o0, o0 + kOwn, other_count, seq.shift)
                                          : band_keys(p, o0, o0 + kOwn, other_count, seq.shift);
  const int64_t t_begin = streamed.begin / kOther * kOther, t_end = streamed.end;
  for (int64_t g = 0; g < (kKeyTile ? p.kv_group : 1); ++g) {
    const int64_t q_head = kKeyTile ? kv_head * p.kv_group + g : own_head;
    const int64_t q_row = seq.query_row(p.H, q_head);  // row 0 of the query head's lse, Δ and dlse
    const PairMaskHead<scalar_t> pair_mask = pair_mask_head<scalar_t>(p, b, q_head, seq.shift);
    for (int64_t t0 = t_begin; t0 < t_end; t0 += kOther) {
      const int other_valid = static_cast<int>(other_count - t0 < kOther ? other_count - t0 : kOther);
      __syncthreads();  // every warp is done with the previous streamed tile (and the own tile is loaded)
      bool nonfinite = false;
      load_side<scalar_t, kThreads, kOther, kDim>(other, ld, p, !kKeyTile, seq, kKeyTile ? q_head : kv_head, t0,
                                                  other_valid, kPairMasks ? &nonfinite : nullptr);
      if (kKeyTile) {
        load_query_stats(stats, p, q_row + t0, kOther, other_valid);
      } else {
        load_key_biases(bias, p, seq, t0, kOther, other_valid);
      }
      if (kPairMasks) {
        nonfinite = __syncthreads_or(nonfinite) != 0;  // block-uniform: the products' branch below
      } else {
        __syncthreads();
      }

      warp_gemm_abt<scalar_t, kDim, kOther>(s_rows, L::score_stride, own + row0 * ld, other, ld);
      warp_gemm_abt<scalar_t, kDim, kOther>(dp_rows, L::score_stride, own + (kOwn + row0) * ld, other + kOther * ld,
                                            ld);
      __syncwarp();
      const int64_t m0 = kKeyTile ? t0 : o0, n0 = kKeyTile ? o0 : t0;
      const int m_valid = kKeyTile ? other_valid : own_valid;
      for (int idx = lane; idx < 16 * kOther; idx += 32) {
        const int r = idx / kOther, t = idx % kOther;
        const int query = kKeyTile ? t : row0 + r, key = kKeyTile ? row0 + r : t;
        float key_bias = bias[key];
        bool masked = false;
        if (kPairMasks) {
          key_bias = key_bias == 0.0f && query < m_valid ? pair_mask.bias(m0 + query, n0 + key) : negative_infinity<float>();
          masked = is_negative_infinity(key_bias);
        }
        const float dot = s_rows[r * L::score_stride + t];
        float slope = 1.0f;
        const float prob = softmax_probability(kPairMasks ? pair_mask.score(dot, p.scale, key_bias, &slope)
                                                          : fmaf(dot, p.scale, key_bias), stats[query]);
        const float ds =
            score_gradient(prob, dp_rows[r * L::score_stride + t], stats[64 + query], stats[128 + query]) * slope;
        if (kPairMasks) {
          p_rows[r * L::coef_stride + t] = masked ? from_float<scalar_t>(masked_coefficient()) : allowed_coefficient<scalar_t>(prob);
          ds_rows[r * L::coef_stride + t] = masked ? from_float<scalar_t>(masked_coefficient()) : allowed_coefficient<scalar_t>(ds);
        } else {
          p_rows[r * L::coef_stride + t] = from_float<scalar_t>(prob);
          ds_rows[r * L::coef_stride + t] = from_float<scalar_t>(ds);
        }
      }
      __syncwarp();
      if (kPairMasks && nonfinite) {  // masked pairs must not touch the streamed tile's inf / NaN
        if (kKeyTile) {
          float* acc_v = acc + kOwn * L::acc_stride;
          warp_gemm_acc_exact<scalar_t, kDim, kOther>(acc_v + row0 * L::acc_stride, L::acc_stride, p_rows,
                                                      L::coef_stride, other + kOther * ld, ld, lane);
        }
        warp_gemm_acc_exact<scalar_t, kDim, kOther>(acc + row0 * L::acc_stride, L::acc_stride, ds_rows, L::coef_stride,
                                                    other, ld, lane);
      } else {
        if (kKeyTile) {
          float* acc_v = acc + kOwn * L::acc_stride;
          warp_gemm_acc<scalar_t, kDim, kOther>(acc_v + row0 * L::acc_stride, L::acc_stride, p_rows, L::coef_stride,
                                                other + kOther * ld, ld);  // dV += Pᵀ dO
        }
        warp_gemm_acc<scalar_t, kDim, kOther>(acc + row0 * L::acc_stride, L::acc_stride, ds_rows, L::coef_stride, other,
                                              ld);  // dK += dSᵀ Q, or dQ += dS K
      }
    }
  }
  __syncthreads();  // with no streamed tile, the accumulators were zeroed by other warps' threads

  // Each warp writes its own rows (its accumulator tiles), scaled where the gradient needs it. Padded
  // keys (bias −inf) get 0, even when a NaN query row put 0 · NaN into their accumulators.
  const int64_t base = (kKeyTile ? seq.key_row(heads, own_head) : seq.query_row(p.H, own_head)) + o0;
  scalar_t* grad_a = static_cast<scalar_t*>(kKeyTile ? p.grad_k : p.grad_q) + base * p.D;
  for (int idx = lane; idx < 16 * kDim; idx += 32) {
    const int r = row0 + idx / kDim, c = idx % kDim;
    const bool padded = kKeyTile && is_negative_infinity(bias[r]);
    if (r < own_valid && c < p.D) {
      grad_a[r * p.D + c] = from_float<scalar_t>(padded ? 0.0f : p.scale * acc[r * L::acc_stride + c]);
    }
    if (kKeyTile && r < own_valid && c < p.Dv) {
      static_cast<scalar_t*>(p.grad_v)[(base + r) * p.Dv + c] =
          from_float<scalar_t>(padded ? 0.0f : acc[(kOwn + r) * L::acc_stride + c]);
    }
  }
}

/// kKeyTile: the dK/dV kernel (grid.x = B·H·ceil(N/own)); else the dQ kernel (B·H·ceil(M/own)).
/// Launched with 32·kWarps threads and cross_attention_bwd_wmma_smem(kDim, kWarps, kKeyTile).bytes of
/// dynamic shared memory.
/// kPairMasks: the attention_bwd instantiation (causal / attn_mask, common/pair_mask.cuh).
template <typename scalar_t, int kDim, int kWarps, bool kKeyTile, bool kPairMasks = false>
__global__ void __launch_bounds__(32 * kWarps, 1) cross_attention_bwd_wmma_kernel(const CrossAttentionBwdParams p) {
  if constexpr (kWmmaHasFragments<scalar_t>) {
    cross_attention_bwd_wmma_block<scalar_t, kDim, kWarps, kKeyTile, kPairMasks>(p);
  } else {
    __trap();  // bf16 below sm_80: the plans refuse it before launching (wmma_tiles.cuh)
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
