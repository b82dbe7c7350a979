// CPU forward of chunked cross attention (SPEC §1): for every (batch, head, tile of query rows) the
// keys are streamed in chunks — scores by GEMM, the online-softmax row update of the shared header,
// the value GEMM into an fp32 accumulator — so that no buffer larger than tile × chunk exists.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <limits>
#include <tuple>
#include <vector>

#include "attn_ext/online_softmax.h"
#include "blas.h"
#include "cross_attention_checks.h"
#include "cross_attention_cpu.h"
#include "tile.h"
#include "vectorized_rows.h"

namespace attn_ext::cpu {
namespace {

// 128 query rows × 512 keys of fp32 scores stay in a 2 MB L2 next to the value accumulator, and
// the two GEMMs per chunk are large enough for the BLAS to run near its peak (measured: 64 rows
// cost 10-15 % more at N = 3e4, 32 rows 50 %).
constexpr int64_t kQueryTile = 128;

template <typename scalar_t>
void forward_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const bool* padding,
                    const CrossAttentionShape& s, double scale_d, int64_t chunk, at::Tensor& out,
                    at::Tensor& lse) {
  using acc_t = at::opmath_type<scalar_t>;
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

  // With key splits each part writes a normalised partial state; they are merged below (SPEC §1 merge).
  std::vector<acc_t> partial_out(splits > 1 ? splits * B * H * M * Dv : 0);
  std::vector<acc_t> partial_lse(splits > 1 ? splits * B * H * M : 0);

  at::parallel_for(0, units * splits, grain_size_for(units * splits, total_macs), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> scores(tile_m * chunk), acc(tile_m * Dv), q_tile(tile_m * D), k_tile(chunk * D),
        v_tile(chunk * Dv);
    std::vector<OnlineSoftmaxRow<acc_t>> rows(tile_m);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t split = unit % splits, tile = (unit / splits) % q_tiles, bh = unit / (splits * q_tiles);
      const int64_t b = bh / H, h = bh % H;
      const int64_t m0 = tile * tile_m, mt = std::min(tile_m, M - m0);
      int64_t c_first, c_last;
      split_range(n_chunks, splits, split, &c_first, &c_last);
      const bool* padding_row = padding ? padding + b * N : nullptr;

      int64_t ldq, ldk, ldv;
      const acc_t* qt = rows_as_acc<acc_t>(q_data + b * q.stride(0) + h * q.stride(1) + m0 * q.stride(2),
                                           q.stride(2), mt, D, q_tile.data(), &ldq);
      std::fill(acc.begin(), acc.begin() + mt * Dv, acc_t(0));
      std::fill(rows.begin(), rows.begin() + mt, online_softmax_empty<acc_t>());

      for (int64_t c = c_first; c < c_last; ++c) {
        const int64_t n0 = c * chunk, nc = std::min(chunk, N - n0);
        const int64_t valid = count_valid_keys(padding_row, n0, nc);
        if (valid == 0) continue;  // a fully padded chunk changes nothing
        const acc_t* kt = rows_as_acc<acc_t>(k_data + b * k.stride(0) + h * k.stride(1) + n0 * k.stride(2),
                                             k.stride(2), nc, D, k_tile.data(), &ldk);
        const acc_t* vt = rows_as_acc<acc_t>(v_data + b * v.stride(0) + h * v.stride(1) + n0 * v.stride(2),
                                             v.stride(2), nc, Dv, v_tile.data(), &ldv);
        gemm(Transpose::kNo, Transpose::kYes, mt, nc, D, scale, qt, ldq, kt, ldk, acc_t(0), scores.data(), nc);
        if (valid < nc) {
          for (int64_t j = 0; j < nc; ++j) {
            if (!padding_row[n0 + j]) continue;
            for (int64_t r = 0; r < mt; ++r) scores[r * nc + j] = negative_infinity<acc_t>();
          }
        }
        for (int64_t r = 0; r < mt; ++r) {
          acc_t* row_scores = scores.data() + r * nc;
          const acc_t factor = online_softmax_advance(rows[r], row_max(row_scores, nc));
          rows[r].sum += exp_shifted_inplace_sum(row_scores, nc, online_softmax_shift(rows[r]));
          if (factor != acc_t(1)) {
            for (int64_t d = 0; d < Dv; ++d) acc[r * Dv + d] *= factor;
          }
        }
        gemm(Transpose::kNo, Transpose::kNo, mt, Dv, nc, acc_t(1), scores.data(), nc, vt, ldv, acc_t(1),
             acc.data(), Dv);
      }

      for (int64_t r = 0; r < mt; ++r) {
        const OnlineSoftmaxResult<acc_t> done = online_softmax_finish(rows[r]);
        const int64_t row = bh * M + m0 + r;
        if (splits == 1) {
          for (int64_t d = 0; d < Dv; ++d) out_data[row * Dv + d] = static_cast<scalar_t>(acc[r * Dv + d] * done.inv_sum);
          lse_data[row] = done.lse;
        } else {
          acc_t* po = partial_out.data() + (split * B * H * M + row) * Dv;
          for (int64_t d = 0; d < Dv; ++d) po[d] = acc[r * Dv + d] * done.inv_sum;
          partial_lse[split * B * H * M + row] = done.lse;
        }
      }
    }
  });

  if (splits == 1) return;
  at::parallel_for(0, B * H * M, 64, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> merged(Dv);
    for (int64_t row = begin; row < end; ++row) {
      acc_t merged_lse = negative_infinity<acc_t>();
      std::fill(merged.begin(), merged.end(), acc_t(0));
      for (int64_t split = 0; split < splits; ++split) {
        const StateMergeWeights<acc_t> w = state_merge_weights(merged_lse, partial_lse[split * B * H * M + row]);
        const acc_t* po = partial_out.data() + (split * B * H * M + row) * Dv;
        for (int64_t d = 0; d < Dv; ++d) merged[d] = w.weight_a * merged[d] + w.weight_b * po[d];
        merged_lse = w.lse;
      }
      for (int64_t d = 0; d < Dv; ++d) out_data[row * Dv + d] = static_cast<scalar_t>(merged[d]);
      lse_data[row] = merged_lse;
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> cross_attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v,
                                                          const std::optional<at::Tensor>& key_padding_mask,
                                                          double scale, int64_t chunk_size) {
  const CrossAttentionShape s = check_cross_attention_inputs(q, k, v, key_padding_mask, scale, chunk_size);
  TORCH_CHECK(q.device().is_cpu(), "attn_ext: the CPU kernel got tensors on ", q.device());
  // BLAS needs unit stride along the head dim; other strides are handled by the tile loaders.
  const at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  const at::Tensor kc = k.stride(3) == 1 ? k : k.contiguous();
  const at::Tensor vc = v.stride(3) == 1 ? v : v.contiguous();
  at::Tensor mask;
  if (key_padding_mask.has_value()) mask = key_padding_mask->contiguous();
  at::Tensor out = at::empty({s.batch, s.heads, s.queries, s.value_dim}, q.options());
  at::Tensor lse = at::empty({s.batch, s.heads, s.queries}, q.options().dtype(lse_dtype_for(q.scalar_type())));
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "attn_ext::cross_attention_fwd", [&] {
    forward_kernel<scalar_t>(qc, kc, vc, mask.defined() ? mask.const_data_ptr<bool>() : nullptr, s, scale,
                             chunk_size, out, lse);
  });
  return {out, lse};
}

}  // namespace attn_ext::cpu
