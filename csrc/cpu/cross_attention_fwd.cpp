// CPU forward of chunked cross attention (docs/spec.md §1): for every (batch, head, tile of query rows) the
// keys are streamed in chunks by attend_tile (attention_tile.h), so that no buffer larger than
// tile × chunk exists.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <limits>
#include <tuple>
#include <vector>

#include "attention_tile.h"
#include "attn_ext/online_softmax.h"
#include "checks/cross_attention_checks.h"
#include "ops.h"
#include "tile.h"

namespace attn_ext::cpu {
namespace {

template <typename scalar_t>
void forward_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const bool* padding,
                    const CrossAttentionShape& s, double scale_d, int64_t chunk, at::Tensor& out,
                    at::Tensor& lse) {
  using acc_t = acc_type<scalar_t>;
  const acc_t scale = static_cast<acc_t>(scale_d);
  const int64_t B = s.batch, H = s.heads, M = s.queries, N = s.keys, D = s.head_dim, Dv = s.value_dim;
  const int64_t tile_m = std::min<int64_t>(kQueryTile, std::max<int64_t>(M, 1));
  chunk = std::min<int64_t>(chunk, std::max<int64_t>(N, 1));
  const int64_t q_tiles = (M + tile_m - 1) / tile_m;
  const int64_t n_chunks = (N + chunk - 1) / chunk;
  const int64_t units = B * H * q_tiles;
  const int64_t total_macs = B * H * M * N * (D + Dv);
  const int64_t splits = key_splits_for(units, n_chunks, total_macs);

  const scalar_t* q_data = q.const_data_ptr<scalar_t>();
  const scalar_t* k_data = k.const_data_ptr<scalar_t>();
  const scalar_t* v_data = v.const_data_ptr<scalar_t>();
  scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
  acc_t* lse_data = lse.mutable_data_ptr<acc_t>();

  // With key splits each part writes a normalised partial state; they are merged below (docs/spec.md §1 merge).
  std::vector<acc_t> partial_out(splits > 1 ? splits * B * H * M * Dv : 0);
  std::vector<acc_t> partial_lse(splits > 1 ? splits * B * H * M : 0);

  at::parallel_for(0, units * splits, grain_size_for(units * splits, total_macs), [&](int64_t begin, int64_t end) {
    AttentionTileScratch<acc_t> scratch(tile_m, chunk, D, Dv);
    std::vector<acc_t> q_tile(tile_m * D);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t split = unit % splits, tile = (unit / splits) % q_tiles, bh = unit / (splits * q_tiles);
      const int64_t b = bh / H, h = bh % H;
      const int64_t m0 = tile * tile_m, mt = std::min(tile_m, M - m0);
      int64_t c_first, c_last;
      split_range(n_chunks, splits, split, &c_first, &c_last);
      const KeyValueRows<scalar_t> kv{k_data + b * k.stride(0) + h * k.stride(1), v_data + b * v.stride(0) + h * v.stride(1),
                                      k.stride(2), v.stride(2), padding ? padding + b * N : nullptr, N, D, Dv};
      int64_t ldq;
      const acc_t* qt = rows_as_acc<acc_t>(q_data + b * q.stride(0) + h * q.stride(1) + m0 * q.stride(2),
                                           q.stride(2), mt, D, q_tile.data(), &ldq);
      attend_tile(qt, ldq, mt, scale, kv, chunk, c_first, c_last, scratch);
      const int64_t row = bh * M + m0;
      if (splits == 1) {
        store_tile(scratch, mt, Dv, out_data + row * Dv, lse_data + row);
      } else {  // each part writes a normalised partial state, merged below
        store_tile(scratch, mt, Dv, partial_out.data() + (split * B * H * M + row) * Dv,
                   partial_lse.data() + split * B * H * M + row);
      }
    }
  });

  if (splits > 1) merge_partial_states(partial_out.data(), partial_lse.data(), splits, B * H * M, Dv, out_data, lse_data);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> cross_attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v,
                                                          const std::optional<at::Tensor>& key_padding_mask,
                                                          double scale, int64_t chunk_size) {
  const CrossAttentionShape s = check_cross_attention_inputs(q, k, v, key_padding_mask, scale, chunk_size);
  TORCH_CHECK(q.device().is_cpu(), "attn_ext: the CPU kernel got tensors on ", q.device());
  // BLAS needs unit stride along the head dim; other strides are handled by the tile loaders.
  const at::Tensor qc = with_unit_inner_stride(q);
  const at::Tensor kc = with_unit_inner_stride(k);
  const at::Tensor vc = with_unit_inner_stride(v);
  at::Tensor mask;
  if (key_padding_mask.has_value()) mask = key_padding_mask->contiguous();
  at::Tensor out = at::empty({s.batch, s.heads, s.queries, s.value_dim}, q.options());
  at::Tensor lse = at::empty({s.batch, s.heads, s.queries}, q.options().dtype(accumulation_dtype(q.scalar_type())));
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "attn_ext::cross_attention_fwd", [&] {
    forward_kernel<scalar_t>(qc, kc, vc, mask.defined() ? mask.const_data_ptr<bool>() : nullptr, s, scale,
                             chunk_size, out, lse);
  });
  return {out, lse};
}

}  // namespace attn_ext::cpu
