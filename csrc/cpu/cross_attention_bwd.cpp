// CPU backward of chunked cross attention (docs/spec.md §1 backward, as in FlashAttention): probabilities
// are recomputed per (query tile, key chunk) from the saved log-sum-exp, so no [M, N] matrix exists.
//
// Work is split over (batch·head, part of the keys). Each unit owns the key/value gradients of its
// keys outright and writes a partial query gradient that is summed in a fixed order at the end:
// no atomics, so the result is bit-identical run to run.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "attn_ext/online_softmax.h"
#include "blas.h"
#include "checks/cross_attention_checks.h"
#include "ops.h"
#include "tile.h"
#include "vectorized_rows.h"

namespace attn_ext::cpu {
namespace {

constexpr int64_t kQueryTile = 64;

template <typename scalar_t>
const scalar_t* matrix_at(const at::Tensor& t, int64_t b, int64_t h, int64_t row) {
  return t.const_data_ptr<scalar_t>() + b * t.stride(0) + h * t.stride(1) + row * t.stride(2);
}

// Keys [n0, n0 + nc) of (b, h) as acc_t. Padded keys are never read. Their dS is set to exactly 0
// (whatever dP = dO·vᵀ their values give, inf included), so V goes in as it is; dQ += dS·K then
// needs finite K rows: inf/NaN ones are zeroed (0 · inf = NaN). Shared by the main loop and the
// normaliser pre-pass so that both compute bit-identical scores.
template <typename acc_t, typename scalar_t>
const acc_t* key_tile(const at::Tensor& k, int64_t b, int64_t h, int64_t n0, int64_t nc, int64_t D,
                      const bool* padding_row, int64_t valid, acc_t* scratch, int64_t* ldk) {
  const scalar_t* k_rows = matrix_at<scalar_t>(k, b, h, n0);
  const bool zero_padded_k =
      valid < nc && valid > 0 && !padded_rows_finite<acc_t>(k_rows, k.stride(2), nc, D, padding_row + n0);
  return zero_padded_k ? rows_as_acc_unpadded<acc_t>(k_rows, k.stride(2), nc, D, padding_row + n0, scratch, ldk)
                       : rows_as_acc<acc_t>(k_rows, k.stride(2), nc, D, scratch, ldk);
}

// P = exp(s − lse) loses relative accuracy |lse|·u to the rounding of lse itself: beyond ~2^24 the
// log Σ exp(s − max) ∈ [0, log N] part vanishes entirely (two tied keys get P = 1 each, not ½, and
// every gradient of the row doubles). Rows with |lse| at least this large (relative error of P up
// to 2^-15 otherwise) get their normaliser recomputed exactly as (max, log sum) by a pre-pass over
// the keys. Such scores mean a saturated softmax, so ordinary inputs never pay for the pass.
constexpr float kPreciseNormaliserLse = 512.0f;

template <typename scalar_t>
void backward_kernel(const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& q,
                     const at::Tensor& k, const at::Tensor& v, const bool* padding, const at::Tensor& out,
                     const at::Tensor& lse, const CrossAttentionShape& s, double scale_d, int64_t chunk,
                     at::Tensor& grad_q, at::Tensor& grad_k, at::Tensor& grad_v) {
  using acc_t = acc_type<scalar_t>;
  const acc_t scale = static_cast<acc_t>(scale_d);
  const int64_t B = s.batch, H = s.heads, M = s.queries, N = s.keys, D = s.head_dim, Dv = s.value_dim;
  const int64_t tile_m = std::min<int64_t>(kQueryTile, std::max<int64_t>(M, 1));
  chunk = std::min<int64_t>(chunk, std::max<int64_t>(N, 1));
  const int64_t n_chunks = (N + chunk - 1) / chunk;
  const int64_t total_macs = 2 * B * H * M * N * (D + Dv);
  const int64_t splits = key_splits_for(B * H, n_chunks, total_macs);
  const acc_t* lse_data = lse.const_data_ptr<acc_t>();
  const acc_t* grad_lse_data = grad_lse.const_data_ptr<acc_t>();

  // Δ_i − dlse_i per query row, the only per-row quantity dS needs besides P and dP.
  std::vector<acc_t> delta_minus_dlse(B * H * M);
  at::parallel_for(0, B * H * M, 256, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t bh = row / M, m = row % M;
      const scalar_t* o = matrix_at<scalar_t>(out, bh / H, bh % H, m);
      const scalar_t* dout = matrix_at<scalar_t>(grad_out, bh / H, bh % H, m);
      acc_t delta = 0;
      for (int64_t d = 0; d < Dv; ++d) delta += static_cast<acc_t>(o[d]) * static_cast<acc_t>(dout[d]);
      delta_minus_dlse[row] = delta - grad_lse_data[row];
    }
  });

  // Exact normaliser (row max, log Σ exp(s − max)) of rows with a huge lse; see kPreciseNormaliserLse.
  // Scores come from the same GEMM calls (tile, chunk, operands) as the main loop, so P sums to 1.
  const int64_t n_tiles = (M + tile_m - 1) / tile_m;
  std::vector<char> precise(B * H * M, 0);
  std::vector<acc_t> row_shift(B * H * M), row_log_sum(B * H * M);
  at::parallel_for(0, B * H * n_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> scores, q_tile, k_tile;
    std::vector<OnlineSoftmaxRow<acc_t>> rows;
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t bh = unit / n_tiles, b = bh / H, h = bh % H, m0 = (unit % n_tiles) * tile_m;
      const int64_t mt = std::min(tile_m, M - m0);
      bool any = false;
      for (int64_t r = 0; r < mt; ++r) {
        const acc_t l = lse_data[bh * M + m0 + r];
        any = any || (std::isfinite(l) && std::abs(l) >= acc_t(kPreciseNormaliserLse));
      }
      if (!any) continue;
      scores.resize(tile_m * chunk), q_tile.resize(tile_m * D), k_tile.resize(chunk * D), rows.resize(tile_m);
      const bool* padding_row = padding ? padding + b * N : nullptr;
      int64_t ldq, ldk;
      const acc_t* qt = rows_as_acc<acc_t>(matrix_at<scalar_t>(q, b, h, m0), q.stride(2), mt, D, q_tile.data(), &ldq);
      std::fill(rows.begin(), rows.begin() + mt, online_softmax_empty<acc_t>());
      for (int64_t c = 0; c < n_chunks; ++c) {
        const int64_t n0 = c * chunk, nc = std::min(chunk, N - n0);
        const int64_t valid = count_valid_keys(padding_row, n0, nc);
        if (valid == 0) continue;
        const acc_t* kt = key_tile<acc_t, scalar_t>(k, b, h, n0, nc, D, padding_row, valid, k_tile.data(), &ldk);
        gemm(Transpose::kNo, Transpose::kYes, mt, nc, D, scale, qt, ldq, kt, ldk, acc_t(0), scores.data(), nc);
        for (int64_t r = 0; r < mt; ++r) {
          acc_t* row_s = scores.data() + r * nc;
          for (int64_t j = 0; j < nc && valid < nc; ++j) row_s[j] = padding_row[n0 + j] ? negative_infinity<acc_t>() : row_s[j];
          online_softmax_advance(rows[r], row_max(row_s, nc));
          rows[r].sum += exp_shifted_inplace_sum(row_s, nc, online_softmax_shift(rows[r]));
        }
      }
      for (int64_t r = 0; r < mt; ++r) {
        const int64_t row = bh * M + m0 + r;
        const acc_t l = lse_data[row];
        // Only rows the forward found finite; a sum that is not > 0 (NaN) keeps the lse path.
        if (!(std::isfinite(l) && std::abs(l) >= acc_t(kPreciseNormaliserLse) && rows[r].sum > acc_t(0))) continue;
        precise[row] = 1, row_shift[row] = rows[r].max, row_log_sum[row] = std::log(rows[r].sum);
      }
    }
  });

  std::vector<acc_t> partial_grad_q(splits * B * H * M * D, acc_t(0));
  scalar_t* grad_k_data = grad_k.mutable_data_ptr<scalar_t>();
  scalar_t* grad_v_data = grad_v.mutable_data_ptr<scalar_t>();

  at::parallel_for(0, B * H * splits, grain_size_for(B * H * splits, total_macs), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> p(tile_m * chunk), dp(tile_m * chunk), q_tile(tile_m * D), do_tile(tile_m * Dv),
        k_tile(chunk * D), v_tile(chunk * Dv), dk(chunk * D), dv(chunk * Dv);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t split = unit % splits, bh = unit / splits, b = bh / H, h = bh % H;
      const bool* padding_row = padding ? padding + b * N : nullptr;
      acc_t* grad_q_part = partial_grad_q.data() + (split * B * H + bh) * M * D;
      int64_t c_first, c_last;
      split_range(n_chunks, splits, split, &c_first, &c_last);
      for (int64_t c = c_first; c < c_last; ++c) {
        const int64_t n0 = c * chunk, nc = std::min(chunk, N - n0);
        std::fill(dk.begin(), dk.begin() + nc * D, acc_t(0));
        std::fill(dv.begin(), dv.begin() + nc * Dv, acc_t(0));
        const int64_t valid = count_valid_keys(padding_row, n0, nc);
        int64_t ldk, ldv, ldq, lddo;
        const acc_t* kt = key_tile<acc_t, scalar_t>(k, b, h, n0, nc, D, padding_row, valid, k_tile.data(), &ldk);
        const acc_t* vt = rows_as_acc<acc_t>(matrix_at<scalar_t>(v, b, h, n0), v.stride(2), nc, Dv, v_tile.data(), &ldv);
        for (int64_t m0 = 0; m0 < M && valid > 0; m0 += tile_m) {
          const int64_t mt = std::min(tile_m, M - m0);
          const acc_t* qt = rows_as_acc<acc_t>(matrix_at<scalar_t>(q, b, h, m0), q.stride(2), mt, D, q_tile.data(), &ldq);
          const acc_t* dot = rows_as_acc<acc_t>(matrix_at<scalar_t>(grad_out, b, h, m0), grad_out.stride(2), mt, Dv,
                                                do_tile.data(), &lddo);
          // P = exp(scale·q·kᵀ − lse), 0 for padded keys and for rows without any valid key. A NaN row
          // (lse NaN) gets NaN everywhere, padded keys included: its own gradients are NaN anyway
          // (padded keys' dS is zeroed below), and the padded keys' dK/dV are written as zeros.
          gemm(Transpose::kNo, Transpose::kYes, mt, nc, D, scale, qt, ldq, kt, ldk, acc_t(0), p.data(), nc);
          for (int64_t r = 0; r < mt; ++r) {
            acc_t* row_p = p.data() + r * nc;
            const acc_t row_lse = lse_data[bh * M + m0 + r];
            if (is_negative_infinity(row_lse)) {
              std::fill(row_p, row_p + nc, acc_t(0));
              continue;
            }
            if (valid < nc) {
              for (int64_t j = 0; j < nc; ++j) row_p[j] = padding_row[n0 + j] ? negative_infinity<acc_t>() : row_p[j];
            }
            if (precise[bh * M + m0 + r]) {  // exp((s − max) − log sum): s − max is exact near the max
              const acc_t shift = row_shift[bh * M + m0 + r];
              for (int64_t j = 0; j < nc; ++j) row_p[j] -= shift;
              exp_shifted_inplace_sum(row_p, nc, row_log_sum[bh * M + m0 + r]);
            } else {
              exp_shifted_inplace_sum(row_p, nc, row_lse);
            }
          }
          // dV += Pᵀ·dO ; dP = dO·Vᵀ ; dS = P ⊙ (dP − Δ + dlse) ; dK += scale·dSᵀ·Q ; dQ += scale·dS·K
          gemm(Transpose::kYes, Transpose::kNo, nc, Dv, mt, acc_t(1), p.data(), nc, dot, lddo, acc_t(1), dv.data(), Dv);
          gemm(Transpose::kNo, Transpose::kYes, mt, nc, Dv, acc_t(1), dot, lddo, vt, ldv, acc_t(0), dp.data(), nc);
          for (int64_t r = 0; r < mt; ++r) {
            score_gradient_row(p.data() + r * nc, dp.data() + r * nc, dp.data() + r * nc, nc,
                               delta_minus_dlse[bh * M + m0 + r]);
          }
          if (valid < nc) {  // P = 0 there, but 0 · (dP − Δ) is NaN when dP or Δ is not finite
            for (int64_t j = 0; j < nc; ++j) {
              if (!padding_row[n0 + j]) continue;
              for (int64_t r = 0; r < mt; ++r) dp[r * nc + j] = acc_t(0);
            }
          }
          gemm(Transpose::kYes, Transpose::kNo, nc, D, mt, scale, dp.data(), nc, qt, ldq, acc_t(1), dk.data(), D);
          gemm(Transpose::kNo, Transpose::kNo, mt, D, nc, scale, dp.data(), nc, kt, ldk, acc_t(1), grad_q_part + m0 * D, D);
        }
        for (int64_t j = 0; j < nc; ++j) {
          scalar_t* gk = grad_k_data + (bh * N + n0 + j) * D;
          scalar_t* gv = grad_v_data + (bh * N + n0 + j) * Dv;
          // A padded key takes no part in the attention, so its gradients are 0 even beside a NaN query
          // row, whose dS·Q would otherwise put 0 · NaN = NaN there.
          const bool padded = padding_row != nullptr && padding_row[n0 + j];
          for (int64_t d = 0; d < D; ++d) gk[d] = static_cast<scalar_t>(padded ? acc_t(0) : dk[j * D + d]);
          for (int64_t d = 0; d < Dv; ++d) gv[d] = static_cast<scalar_t>(padded ? acc_t(0) : dv[j * Dv + d]);
        }
      }
    }
  });

  scalar_t* grad_q_data = grad_q.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, B * H * M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t d = 0; d < D; ++d) {
        acc_t sum = 0;
        for (int64_t split = 0; split < splits; ++split) sum += partial_grad_q[(split * B * H * M + row) * D + d];
        grad_q_data[row * D + d] = static_cast<scalar_t>(sum);
      }
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_attention_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const std::optional<at::Tensor>& key_padding_mask, const at::Tensor& out,
    const at::Tensor& lse, double scale, int64_t chunk_size) {
  const CrossAttentionShape s = check_cross_attention_inputs(q, k, v, key_padding_mask, scale, chunk_size);
  check_cross_attention_grads(s, q, grad_out, grad_lse, out, lse);
  TORCH_CHECK(q.device().is_cpu(), "attn_ext: the CPU kernel got tensors on ", q.device());
  const at::Tensor qc = with_unit_inner_stride(q), kc = with_unit_inner_stride(k), vc = with_unit_inner_stride(v),
                   oc = with_unit_inner_stride(out), doc = with_unit_inner_stride(grad_out);
  const at::Tensor lse_c = lse.contiguous(), grad_lse_c = grad_lse.contiguous();
  at::Tensor mask;
  if (key_padding_mask.has_value()) mask = key_padding_mask->contiguous();
  at::Tensor grad_q = at::empty({s.batch, s.heads, s.queries, s.head_dim}, q.options());
  at::Tensor grad_k = at::empty({s.batch, s.heads, s.keys, s.head_dim}, k.options());
  at::Tensor grad_v = at::empty({s.batch, s.heads, s.keys, s.value_dim}, v.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "attn_ext::cross_attention_bwd", [&] {
    backward_kernel<scalar_t>(doc, grad_lse_c, qc, kc, vc, mask.defined() ? mask.const_data_ptr<bool>() : nullptr, oc,
                              lse_c, s, scale, chunk_size, grad_q, grad_k, grad_v);
  });
  return {grad_q, grad_k, grad_v};
}

}  // namespace attn_ext::cpu
