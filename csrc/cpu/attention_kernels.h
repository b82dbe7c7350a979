// The CPU attention kernels behind attn_ext::attention_fwd/bwd and attn_ext::cross_attention_fwd/bwd
// (the latter are the case without attn_mask, causal, dropout or grouped heads): one implementation,
// called by the ops of attention_ops.cpp once their arguments are checked.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "attention_masking.h"

namespace attn_ext::cpu {

/// The query rows [q_begin, q_end) and key rows [k_begin, k_end) of batch entry b that attend each other: a whole
/// batch entry, or one sequence of a packed (varlen) batch (b = 0). `band` and `diagonal` are in the rows'
/// global numbering (the sequence's own band shifted by k_begin − q_begin).
struct Segment {
  int64_t b, q_begin, q_end, k_begin, k_end;
  Band band;
  int64_t diagonal;  ///< query m's diagonal key m + diagonal (ALiBi's distances)
};

/// Checked inputs of one attention call. q [B, Hq, L, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] with
/// unit inner stride; attn_mask undefined or a [B, Hq, L, S] view (any strides) of bool or q's
/// dtype; padding undefined or a contiguous bool [B, S].
struct AttentionCall {
  at::Tensor q, k, v, attn_mask, padding;
  double scale;
  Band band;  ///< the causal rule and sliding window (attention_masking.h)
  double dropout_p;
  int64_t seed;
  int64_t chunk;
  double softcap = 0;     ///< > 0: scores c · tanh(s / c)
  at::Tensor alibi;       ///< undefined, or fp32 [segments, Hq] contiguous ALiBi slopes
  int64_t diagonal = 0;   ///< query m's diagonal key m + diagonal (ALiBi's distances)
  /// A packed (varlen) batch: B = 1 and one segment per sequence; or a paged cache: one segment per batch entry
  /// (its keys up to its length); empty: one segment per batch entry over every key.
  std::vector<Segment> packed;
  /// A paged cache: k, v are [num_blocks, block_size, Hkv, ·] and row n of batch entry b is row n % block_size of
  /// block block_table[b, n / block_size] (int32 [B, max_blocks]); undefined: k, v are [B, Hkv, S, ·].
  at::Tensor block_table;
  const char* op = "attn_ext.scaled_dot_product_attention";  ///< the public op, for errors
};

/// The key/value heads and the keys per batch entry of a call (a paged cache: the block table's capacity).
inline int64_t kv_heads(const AttentionCall& call) {
  return call.block_table.defined() ? call.k.size(2) : call.k.size(1);
}
inline int64_t kv_rows(const AttentionCall& call) {
  return call.block_table.defined() ? call.block_table.size(1) * call.k.size(1) : call.k.size(2);
}

/// Row n of key/value head hkv of batch entry b of `t` (the call's k or v), through the block table if paged.
template <typename scalar_t>
const scalar_t* kv_row(const AttentionCall& call, const at::Tensor& t, int64_t b, int64_t hkv, int64_t n) {
  if (!call.block_table.defined()) {
    return t.const_data_ptr<scalar_t>() + b * t.stride(0) + hkv * t.stride(1) + n * t.stride(2);
  }
  const int64_t bs = t.size(1);
  const int64_t block = call.block_table.const_data_ptr<int32_t>()[b * call.block_table.stride(0) + n / bs];
  return t.const_data_ptr<scalar_t>() + block * t.stride(0) + (n % bs) * t.stride(1) + hkv * t.stride(2);
}

/// The segments of a call: its packed sequences, or one per batch entry (every query row over every key).
inline std::vector<Segment> call_segments(const AttentionCall& call) {
  if (!call.packed.empty()) return call.packed;
  std::vector<Segment> segments;
  const int64_t B = call.q.size(0), M = call.q.size(2), N = kv_rows(call);
  for (int64_t b = 0; b < B; ++b) segments.push_back(Segment{b, 0, M, 0, N, call.band, call.diagonal});
  return segments;
}

/// The segment of query row m of batch entry b: `by_row` for a packed batch's sequences (all of entry 0), else the
/// entry's own.
inline int64_t segment_of(const std::vector<Segment>& segments, bool by_row, int64_t b, int64_t m) {
  if (!by_row) return b;
  const auto it = std::upper_bound(segments.begin(), segments.end(), m,
                                   [](int64_t row, const Segment& s) { return row < s.q_end; });
  return static_cast<int64_t>(it - segments.begin());
}

/// The (query, key) pairs of a segment inside its band: the work to expect.
inline int64_t segment_pairs(const Segment& s) {
  if (!s.band.active()) return (s.q_end - s.q_begin) * (s.k_end - s.k_begin);
  int64_t pairs = 0;
  for (int64_t m = s.q_begin; m < s.q_end; ++m) {
    int64_t first, end;
    band_keys(s.band, m, 1, s.k_end, &first, &end);
    pairs += std::max<int64_t>(end - std::max(first, s.k_begin), 0);
  }
  return pairs;
}

/// A tile of a segment's query rows [m0, m0 + mt): the forward's unit of work (with a query head).
struct WorkTile {
  int64_t segment, m0, mt;
};

/// Each segment's query rows cut into tiles of tile_m from its first row.
inline std::vector<WorkTile> work_tiles(const std::vector<Segment>& segments, int64_t tile_m) {
  std::vector<WorkTile> tiles;
  for (int64_t s = 0; s < static_cast<int64_t>(segments.size()); ++s) {
    for (int64_t m0 = segments[s].q_begin; m0 < segments[s].q_end; m0 += tile_m) {
      tiles.push_back(WorkTile{s, m0, std::min(tile_m, segments[s].q_end - m0)});
    }
  }
  return tiles;
}

/// (out [B, Hq, L, Dv] in q's dtype, lse [B, Hq, L] fp32, fp64 for fp64 inputs).
std::tuple<at::Tensor, at::Tensor> attention_forward(const AttentionCall& call);

/// (grad_q, grad_k, grad_v), contiguous, from the gradients of out and lse and the saved out, lse. With `grad_mask`
/// not null (the call's additive attn_mask; no packed batch) also the mask's gradient, in the accumulation dtype,
/// of its [B, Hq, L, S] view's shape with the broadcast dims (stride 0) of size 1.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(const AttentionCall& call, const at::Tensor& grad_out,
                                                                  const at::Tensor& grad_lse, const at::Tensor& out,
                                                                  const at::Tensor& lse,
                                                                  at::Tensor* grad_mask = nullptr);

/// The mask plane of (b, h) of a [B, Hq, L, S] attn_mask view.
template <typename Plane>
Plane mask_plane(const at::Tensor& mask, int64_t b, int64_t h) {
  if constexpr (kHasMask<Plane>) {
    using mask_t = std::remove_cv_t<std::remove_pointer_t<decltype(Plane::data)>>;
    return Plane{mask.const_data_ptr<mask_t>() + b * mask.stride(0) + h * mask.stride(1), mask.stride(2),
                 mask.stride(3)};
  } else {
    return Plane{};
  }
}

/// Every rule of the pairs of segment `index` of `segments` for query head h: key padding, the attn_mask plane,
/// the band and key range, soft cap, ALiBi.
template <typename Plane>
PairRule<Plane> pair_rule(const AttentionCall& call, const std::vector<Segment>& segments, int64_t index, int64_t h) {
  const Segment& seg = segments[index];
  PairRule<Plane> rule{call.padding.defined() ? call.padding.const_data_ptr<bool>() + seg.b * kv_rows(call) : nullptr,
                       mask_plane<Plane>(call.attn_mask, seg.b, h), seg.band};
  rule.key_begin = seg.k_begin, rule.key_end = seg.k_end;
  rule.softcap = call.softcap;
  rule.diagonal = seg.diagonal;
  if (call.alibi.defined()) rule.alibi_slope = call.alibi.const_data_ptr<float>()[index * call.q.size(1) + h];
  return rule;
}

/// Dropout of (b, h) for a call with Hq query heads, L queries, S keys.
inline DropoutRule dropout_rule(const AttentionCall& call, int64_t b, int64_t h, int64_t Hq, int64_t L, int64_t S) {
  if (!(call.dropout_p > 0)) return DropoutRule{false, 0, 0, 1.0, 0, S};
  return DropoutRule{true, static_cast<uint64_t>(call.seed), dropout_threshold(call.dropout_p), 1.0 / (1.0 - call.dropout_p),
                     dropout_counter(b, h, 0, 0, Hq, L, S), S};
}

/// Runs f.template operator()<Plane>() for the attn_mask kind of `call` (scalar_t: q's element type).
template <typename scalar_t, typename F>
void dispatch_mask_kind(const AttentionCall& call, F&& f) {
  if (!call.attn_mask.defined()) {
    f.template operator()<NoMask>();
  } else if (call.attn_mask.scalar_type() == at::kBool) {
    f.template operator()<MaskPlane<bool>>();
  } else {
    f.template operator()<MaskPlane<scalar_t>>();
  }
}

}  // namespace attn_ext::cpu
