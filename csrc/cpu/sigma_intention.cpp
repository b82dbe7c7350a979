// CPU forward of σIntention (docs/spec.md §4), fused: softmax(scale·Q (KᵀK + αI)⁻¹ Kᵀ) V with the
// transformed queries Q̃ = scale·Q W, W = (KᵀK + αI)⁻¹, made tile by tile where they are consumed:
//  1. per (batch, head): the factor L and W (intention_head.h: Gram over the valid keys, Cholesky,
//     solve against the identity);
//  2. per (batch, head, tile of query rows[, part of the keys]): the tile of Q̃ by one GEMM into a
//     thread-local buffer, then attend_tile over the keys (attention_tile.h).
// Against intention_fwd(v=None) followed by cross_attention_fwd this saves a pass that writes Q̃ and
// one that reads it back, and a second trip through the dispatcher and the thread pool. Q̃ is still
// stored, because the backward (the two ops' backwards, composed in Python) needs it; fp16/bf16
// tiles are rounded to the stored dtype before the attention, so the result is the unfused path's.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <tuple>
#include <type_traits>
#include <vector>

#include "attention_tile.h"
#include "blas.h"
#include "intention_head.h"
#include "ops.h"
#include "tile.h"

namespace attn_ext::cpu {
namespace {

using namespace intention;

/// Stage 2: per (batch, head, query tile, key part), Q̃ tile = scale·Q tile·W, stored, then attended.
template <typename scalar_t, typename acc_t>
void attend_transformed_queries(const IntentionArgs<scalar_t>& a, const scalar_t* v, int64_t vs0, int64_t vs1,
                                int64_t vs2, int64_t Dv, const acc_t* weights, acc_t scale, int64_t chunk,
                                scalar_t* q_tilde, scalar_t* out, acc_t* lse) {
  const int64_t B = a.B, H = a.H, M = a.M, N = a.N, D = a.D;
  const int64_t tile_m = std::min<int64_t>(kQueryTile, std::max<int64_t>(M, 1));
  chunk = std::min<int64_t>(chunk, std::max<int64_t>(N, 1));
  const int64_t q_tiles = (M + tile_m - 1) / tile_m, n_chunks = (N + chunk - 1) / chunk;
  const int64_t units = B * H * q_tiles;
  const int64_t total_macs = B * H * M * (N * (D + Dv) + D * D);
  const int64_t splits = key_splits_for(units, n_chunks, total_macs);
  SplitRows<scalar_t, acc_t> results(splits, B * H * M, Dv, out, lse);

  at::parallel_for(0, units * splits, grain_size_for(units * splits, total_macs), [&](int64_t begin, int64_t end) {
    AttentionTileScratch<acc_t> scratch(tile_m, chunk, D, Dv);
    std::vector<acc_t> q_rows(tile_m * D), q_transformed(tile_m * D);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t split = unit % splits, tile = (unit / splits) % q_tiles, bh = unit / (splits * q_tiles);
      const int64_t b = bh / H, h = bh % H;
      const int64_t m0 = tile * tile_m, mt = std::min(tile_m, M - m0);
      int64_t ldq, c_first, c_last;
      split_range(n_chunks, splits, split, &c_first, &c_last);
      const acc_t* qt = rows_as_acc<acc_t>(a.q + b * a.qs0 + h * a.qs1 + m0 * a.qs2, a.qs2, mt, D, q_rows.data(), &ldq);
      acc_t* qw = q_transformed.data();
      gemm(Transpose::kNo, Transpose::kNo, mt, D, D, scale, qt, ldq, weights + bh * D * D, D, acc_t(0), qw, D);
      // A NaN row of Q̃ is what makes the attention give a NaN row; ±inf in Q̃ could instead give
      // all −inf scores, which the attention treats as a row without keys (output 0).
      nan_rows_of_nonfinite_queries(qt, ldq, mt, D, scale, qw, D, D);
      scalar_t* stored = q_tilde + (bh * M + m0) * D;
      if (split == 0) {  // every key part makes the same tile; one of them stores it
        for (int64_t i = 0; i < mt * D; ++i) stored[i] = static_cast<scalar_t>(qw[i]);
      }
      if constexpr (!std::is_same_v<scalar_t, acc_t>) {
        for (int64_t i = 0; i < mt * D; ++i) qw[i] = static_cast<acc_t>(static_cast<scalar_t>(qw[i]));
      }
      const KeyValueRows<scalar_t> kv{a.k + b * a.ks0 + h * a.ks1, v + b * vs0 + h * vs1, a.ks2, vs2,
                                      a.mask ? a.mask + b * N : nullptr, N, D, Dv};
      attend_tile(static_cast<const acc_t*>(qw), D, mt, acc_t(1), kv, chunk, c_first, c_last, scratch);
      results.store(scratch, split, bh * M + m0, mt);
    }
  });
  results.finish();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> sigma_intention_fwd_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& key_padding_mask,
    const at::Tensor& alpha, double scale, int64_t chunk_size) {
  const CrossAttentionShape s = check_cross_attention_inputs(q, k, v, key_padding_mask, scale, chunk_size);
  TORCH_CHECK(q.device().is_cpu(), "attn_ext: the CPU kernel got tensors on ", q.device());
  check_intention_alpha(alpha, s);
  const at::ScalarType acc_dtype = accumulation_dtype(q.scalar_type());
  const at::Tensor qc = with_unit_inner_stride(q), kc = with_unit_inner_stride(k), vc = with_unit_inner_stride(v);
  const at::Tensor mask = key_padding_mask.has_value() ? key_padding_mask->contiguous() : at::Tensor();
  const at::Tensor alpha_c = alpha.to(acc_dtype).contiguous();
  const int64_t D = s.head_dim;
  at::Tensor out = at::empty({s.batch, s.heads, s.queries, s.value_dim}, q.options());
  at::Tensor lse = at::empty({s.batch, s.heads, s.queries}, q.options().dtype(acc_dtype));
  at::Tensor q_tilde = at::empty({s.batch, s.heads, s.queries, D}, q.options());
  at::Tensor factor = at::empty({s.batch, s.heads, D, D}, q.options().dtype(acc_dtype));
  at::Tensor weights = at::empty({s.batch, s.heads, D, D}, q.options().dtype(acc_dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "attn_ext::sigma_intention_fwd", [&] {
    using acc_t = acc_type<scalar_t>;
    const IntentionArgs<scalar_t> a = make_args<scalar_t>(qc, kc, at::Tensor(), mask);  // no values: C = I
    const acc_t* alpha_data = alpha_c.const_data_ptr<acc_t>();
    acc_t* factor_data = factor.mutable_data_ptr<acc_t>();
    acc_t* weights_data = weights.mutable_data_ptr<acc_t>();
    const auto [bad, info] = for_each_head<acc_t>(s.batch * s.heads, D, D, [&](int64_t bh, ForwardScratch<acc_t>& w) {
      const int status = solve_weights(a, bh / s.heads, bh % s.heads, alpha_data[bh], factor_data + bh * D * D,
                                       weights_data + bh * D * D, w);
      return status == kIntentionNonFinite ? 0 : status;  // NaN weights: that head's Q̃, and so its output, is NaN
    });
    check_solvable("sigma_intention", bad, info, s, alpha, key_padding_mask);
    if (out.numel() == 0 && lse.numel() == 0) return;
    attend_transformed_queries<scalar_t, acc_t>(a, vc.const_data_ptr<scalar_t>(), vc.stride(0), vc.stride(1),
                                                vc.stride(2), s.value_dim, weights.const_data_ptr<acc_t>(),
                                                static_cast<acc_t>(scale), chunk_size,
                                                q_tilde.mutable_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
                                                lse.mutable_data_ptr<acc_t>());
  });
  return {out, lse, q_tilde, factor, weights};
}

}  // namespace attn_ext::cpu
