// CPU forward of attention (docs/spec.md §1): for every (batch, query head, tile of query rows) the
// keys of its key/value head are streamed in chunks by attend_tile (attention_tile.h), so that no
// buffer larger than tile × chunk exists. Grouped heads (GQA): query head h reads kv head
// h / (Hq / Hkv), with no copy of k or v. Cross attention is the case Hq = Hkv without masks.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <tuple>
#include <vector>

#include "attention_kernels.h"
#include "attention_tile.h"
#include "checks/common.h"
#include "score_range.h"
#include "tile.h"

namespace attn_ext::cpu {
namespace {

/// Key/value head hkv of batch entry b: [B, Hkv, S, ·] rows, or a paged cache's [num_blocks, block_size, Hkv, ·]
/// read through entry b's row of the block table.
template <typename scalar_t>
KeyValueRows<scalar_t> key_value_rows(const AttentionCall& call, int64_t b, int64_t hkv) {
  const at::Tensor &k = call.k, &v = call.v;
  const scalar_t *k_data = k.const_data_ptr<scalar_t>(), *v_data = v.const_data_ptr<scalar_t>();
  const int64_t N = kv_rows(call), D = k.size(-1), Dv = v.size(-1);
  if (!call.block_table.defined()) {
    return {k_data + b * k.stride(0) + hkv * k.stride(1), v_data + b * v.stride(0) + hkv * v.stride(1), k.stride(2),
            v.stride(2), nullptr, N, D, Dv};
  }
  return {k_data + hkv * k.stride(2), v_data + hkv * v.stride(2), k.stride(1), v.stride(1), nullptr, N, D, Dv,
          call.block_table.const_data_ptr<int32_t>() + b * call.block_table.stride(0), k.size(1), k.stride(0),
          v.stride(0)};
}

/// Decoding over a paged cache: at most this many new tokens per entry take paged_decode.
constexpr int64_t kHeadsTogetherRows = 16;

/// A paged cache's decoding step, all query heads of a batch entry's tile in one work unit, chunk by chunk: a
/// block [block_size, Hkv, D] holds every head's rows side by side, so each head reading its own rows through
/// the whole cache (the general loop) strides through every block Hkv times; here the heads take their turns on
/// a chunk while its blocks are in the cache. Measured, AMD EPYC, 2 threads, B = 4, L = 32768, H = 8, D = 128,
/// one query, 16-key blocks: see bench/results/paged.md.
template <typename scalar_t, typename Plane>
void paged_decode(const AttentionCall& call, const std::vector<Segment>& segments, const std::vector<WorkTile>& tiles,
                  at::Tensor& out, at::Tensor& lse, int64_t total_macs) {
  using acc_t = acc_type<scalar_t>;
  const at::Tensor &q = call.q, &k = call.k, &v = call.v;
  const acc_t scale = static_cast<acc_t>(call.scale);
  const int64_t B = q.size(0), Hq = q.size(1), Hkv = kv_heads(call), M = q.size(2), N = kv_rows(call),
                D = q.size(3), Dv = v.size(3), group = Hq / Hkv, bs = k.size(1);
  const int64_t tile_m = std::min<int64_t>(kQueryTile, std::max<int64_t>(M, 1));
  // Chunks of whole blocks, a few of them: every head's rows of the chunk (Hq · chunk · (D + Dv) values) stay
  // in the core's cache for the next head.
  const int64_t chunk = std::min<int64_t>(std::max<int64_t>(N, 1), std::max<int64_t>(64, bs) / bs * bs);
  const int64_t n_tiles = static_cast<int64_t>(tiles.size());
  const int64_t n_chunks = (N + chunk - 1) / chunk;
  const int64_t splits = key_splits_for(n_tiles, n_chunks, total_macs);
  const scalar_t* q_data = q.const_data_ptr<scalar_t>();
  SplitRows<scalar_t, acc_t> results(splits, B * Hq * M, Dv, out.mutable_data_ptr<scalar_t>(),
                                     lse.mutable_data_ptr<acc_t>());
  at::parallel_for(0, n_tiles * splits, grain_size_for(n_tiles * splits, total_macs), [&](int64_t begin, int64_t end) {
    std::vector<AttentionTileScratch<acc_t>> scratch;
    for (int64_t h = 0; h < Hq; ++h) scratch.emplace_back(tile_m, chunk, D, Dv);
    ScratchBuffer<acc_t> q_tiles(Hq * tile_m * D);
    std::vector<const acc_t*> qt(Hq);
    std::vector<int64_t> ldq(Hq);
    std::vector<PairRule<Plane>> rules;
    std::vector<DropoutRule> drops;
    std::vector<KeyValueRows<scalar_t>> kvs;
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t split = unit % splits;
      const WorkTile& tile = tiles[unit / splits];
      const int64_t b = segments[tile.segment].b, m0 = tile.m0, mt = tile.mt;
      rules.clear(), drops.clear(), kvs.clear();
      for (int64_t h = 0; h < Hq; ++h) {
        rules.push_back(pair_rule<Plane>(call, segments, tile.segment, h));
        drops.push_back(dropout_rule(call, b, h, Hq, M, N));
        kvs.push_back(key_value_rows<scalar_t>(call, b, h / group));
        qt[h] = rows_as_acc<acc_t>(q_data + b * q.stride(0) + h * q.stride(1) + m0 * q.stride(2), q.stride(2), mt, D,
                                   q_tiles.data() + h * tile_m * D, &ldq[h]);
      }
      int64_t n_first, n_end;  // the band and the entry's length do not depend on the head
      rule_keys(rules[0], m0, mt, N, &n_first, &n_end);
      int64_t c_first, c_last;
      split_range((n_end - n_first + chunk - 1) / chunk, splits, split, &c_first, &c_last);
      for (int64_t h = 0; h < Hq; ++h) {
        attend_tile(qt[h], ldq[h], m0, mt, scale, kvs[h], rules[h], drops[h], chunk, c_first, c_first, scratch[h]);
      }
      for (int64_t c = c_first; c < c_last; ++c) {
        for (int64_t h = 0; h < Hq; ++h) {
          attend_tile(qt[h], ldq[h], m0, mt, scale, kvs[h], rules[h], drops[h], chunk, c, c + 1, scratch[h], false);
        }
      }
      for (int64_t h = 0; h < Hq; ++h) results.store(scratch[h], split, (b * Hq + h) * M + m0, mt);
    }
  });
  // A row that is not finite (also a row with no key, lse = −inf) may be an overflow: examine it.
  if (!results.finish()) check_scores_in_range<scalar_t, Plane>(call, out, lse);
}

template <typename scalar_t, typename Plane>
void forward_kernel(const AttentionCall& call, at::Tensor& out, at::Tensor& lse) {
  using acc_t = acc_type<scalar_t>;
  const at::Tensor &q = call.q, &v = call.v;
  const acc_t scale = static_cast<acc_t>(call.scale);
  const int64_t B = q.size(0), Hq = q.size(1), Hkv = kv_heads(call), M = q.size(2), N = kv_rows(call),
                D = q.size(3), Dv = v.size(3);
  const bool paged = call.block_table.defined();
  const int64_t group = Hkv > 0 ? Hq / Hkv : 0;  // Hkv = 0 only with Hq = 0: no head, no work unit
  const int64_t tile_m = std::min<int64_t>(kQueryTile, std::max<int64_t>(M, 1));
  // (A paged cache's chunk is gathered into the chunk's buffer, rows spanning blocks or not: a head's rows lie
  // Hkv·D apart in [num_blocks, block_size, Hkv, D], and packed rows beat BLAS on spread ones (rows_as_acc).
  // Measured, AMD EPYC, 2 threads, one query: 512-key chunks gathered from 256-key blocks beat 256-key chunks read
  // in place, 1.17x against 1.34x the contiguous cache's time; computing a spanning chunk block by block in place
  // instead of gathering it, 1.41x against 1.22x.)
  const int64_t chunk = std::min<int64_t>(call.chunk, std::max<int64_t>(N, 1));
  // Work units: a query head and a tile of a segment's rows (a batch entry's, or a packed sequence's).
  const std::vector<Segment> segments = call_segments(call);
  const std::vector<WorkTile> tiles = work_tiles(segments, tile_m);
  const int64_t n_tiles = static_cast<int64_t>(tiles.size());
  const int64_t n_chunks = (N + chunk - 1) / chunk;
  const int64_t units = Hq * n_tiles;
  int64_t pairs = 0;
  for (const Segment& seg : segments) pairs += segment_pairs(seg);
  const int64_t total_macs = Hq * pairs * (D + Dv);
  if (paged && M <= kHeadsTogetherRows && Hq > 1) {
    paged_decode<scalar_t, Plane>(call, segments, tiles, out, lse, total_macs);
    return;
  }
  const int64_t splits = key_splits_for(units, n_chunks, total_macs);

  const scalar_t* q_data = q.const_data_ptr<scalar_t>();
  // With key splits each part writes a normalised partial state; they are merged below (docs/spec.md §1 merge).
  SplitRows<scalar_t, acc_t> results(splits, B * Hq * M, Dv, out.mutable_data_ptr<scalar_t>(),
                                     lse.mutable_data_ptr<acc_t>());
  at::parallel_for(0, units * splits, grain_size_for(units * splits, total_macs), [&](int64_t begin, int64_t end) {
    AttentionTileScratch<acc_t> scratch(tile_m, chunk, D, Dv);
    ScratchBuffer<acc_t> q_tile(tile_m * D);  // written by rows_as_acc before it is read, when used at all
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t split = unit % splits, h = unit / (splits * n_tiles);
      const WorkTile& tile = tiles[(unit / splits) % n_tiles];
      const int64_t b = segments[tile.segment].b, bh = b * Hq + h, hkv = h / group;
      const int64_t m0 = tile.m0, mt = tile.mt;
      const PairRule<Plane> rule = pair_rule<Plane>(call, segments, tile.segment, h);
      // With a band (causal, window) or a packed sequence only the chunks holding keys the tile may see are split
      // among the parts (attend_tile counts them from the tile's first key: a window's chunks start at its edge).
      int64_t n_first, n_end;
      rule_keys(rule, m0, mt, N, &n_first, &n_end);
      int64_t c_first, c_last;
      split_range((n_end - n_first + chunk - 1) / chunk, splits, split, &c_first, &c_last);
      const KeyValueRows<scalar_t> kv = key_value_rows<scalar_t>(call, b, hkv);
      int64_t ldq;
      const acc_t* qt = rows_as_acc<acc_t>(q_data + b * q.stride(0) + h * q.stride(1) + m0 * q.stride(2),
                                           q.stride(2), mt, D, q_tile.data(), &ldq);
      attend_tile(qt, ldq, m0, mt, scale, kv, rule, dropout_rule(call, b, h, Hq, M, N), chunk, c_first, c_last,
                  scratch);
      results.store(scratch, split, bh * M + m0, mt);
    }
  });
  // A row that is not finite (also a row with no key, lse = −inf) may be an overflow: examine it.
  if (!results.finish()) check_scores_in_range<scalar_t, Plane>(call, out, lse);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_forward(const AttentionCall& call) {
  const at::Tensor& q = call.q;
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2), call.v.size(3)}, q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(accumulation_dtype(q.scalar_type())));
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "attn_ext::attention_fwd", [&] {
    dispatch_mask_kind<scalar_t>(call, [&]<typename Plane>() { forward_kernel<scalar_t, Plane>(call, out, lse); });
  });
  return {out, lse};
}

}  // namespace attn_ext::cpu
