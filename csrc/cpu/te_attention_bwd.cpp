// te_attention_bwd on the CPU (csrc/op_list.h). Work items are (batch entry, tile of keys): an item owns its keys'
// dK, dV and dxk rows and walks every query tile, recomputing the tile's features and logits, P = exp(logit − lse),
// dS = P ∘ (dO·Vᵀ − Δ) with Δ = rowsum(dO ∘ out) − dlse, then pulls dS back through the MLP (te_attention_mlp.h)
// into the features' gradients (the dot products' and the differences') and the weights'. dQ, dxq and the weight
// gradients are summed per thread and added up at the end: memory O(threads·(M + hidden²)), nothing of size M·N.
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#include "ops.h"
#include "te_attention_tile.h"
#include "vectorized_rows.h"

namespace attn_ext::cpu {

namespace {

/// Per-thread sums: dq [B·H·M·D], dxq [B·M·dx] and the weight gradients in TeMlp's layout.
struct ThreadSums {
  at::Tensor dq, dxq, dw1, db1, dw2t, db2;  // each [threads, ...]
};

template <typename T>
void te_backward(const TeProblem<T>& pr, int64_t tile_keys, const T* grad_out, const T* delta, const T* lse,
                 ThreadSums& sums, T* dk, T* dv, T* dxk) {
  const int64_t H = pr.H, M = pr.M, N = pr.N, D = pr.D, Dv = pr.Dv, dx = pr.dx, F = pr.mlp.features;
  const int64_t hp = pr.mlp.hidden;
  const int64_t mt_max = std::min(kTeTileQueries, std::max<int64_t>(M, 1)), tn_max = std::min(tile_keys, N);
  const int64_t P_max = mt_max * te_pair_stride(tn_max);
  const int64_t tiles_n = (N + tile_keys - 1) / tile_keys;
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  at::parallel_for(0, pr.B * tiles_n, 1, [&](int64_t begin, int64_t end) {
    const int64_t t = at::get_thread_num();
    T* dq = sums.dq.template data_ptr<T>() + t * pr.B * H * M * D;
    T* dxq = sums.dxq.template data_ptr<T>() + t * pr.B * M * dx;
    const TeMlpGrads<T> grads{sums.dw1.template data_ptr<T>() + t * hp * F, sums.db1.template data_ptr<T>() + t * hp,
                              sums.dw2t.template data_ptr<T>() + t * hp * H, sums.db2.template data_ptr<T>() + t * H};
    std::vector<T> x(F * P_max), p(H * P_max), ds(H * P_max), dfeat(F * P_max);
    std::vector<T> scratch(te_backward_scratch_size(F, H));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / tiles_n, n0 = item % tiles_n * tile_keys, nt = std::min(tile_keys, N - n0);
      const int64_t stride = te_pair_stride(nt);
      for (int64_t m0 = 0; m0 < M; m0 += kTeTileQueries) {
        const int64_t mt = std::min(kTeTileQueries, M - m0), P = mt * stride;
        stage_te_features(pr, b, m0, mt, n0, nt, x.data());
        te_logits(pr.mlp, x.data(), p.data(), P);
        for (int64_t h = 0; h < H; ++h) {
          const T* dO = grad_out + ((b * H + h) * M + m0) * Dv;
          if (Dv > 0) {  // dP = dO·Vᵀ, into ds
            gemm(Transpose::kNo, Transpose::kYes, mt, nt, Dv, T(1), dO, Dv, pr.v_rows(b, h, n0), Dv, T(0),
                 ds.data() + h * P, stride);
          }
          for (int64_t i = 0; i < mt; ++i) {
            T* p_row = p.data() + h * P + i * stride;
            T* ds_row = ds.data() + h * P + i * stride;
            const int64_t r = (b * H + h) * M + m0 + i;
            if (lse[r] == kNegInf) {  // a row without keys: no probability anywhere
              std::fill(p_row, p_row + stride, T(0));
            } else {
              if (pr.key_padding != nullptr) {
                for (int64_t j = 0; j < nt; ++j) {
                  if (pr.padded(b, n0 + j)) p_row[j] = kNegInf;
                }
              }
              exp_shifted_inplace_sum(p_row, nt, lse[r]);
              std::fill(p_row + nt, p_row + stride, T(0));
            }
            if (Dv == 0) std::fill(ds_row, ds_row + nt, T(0));
            score_gradient_row(p_row, ds_row, ds_row, nt, delta[r]);
            // P = 0 (padded keys, empty rows, pad pairs) adds nothing, also where dP − Δ is not finite.
            for (int64_t j = 0; j < stride; ++j) {
              if (j >= nt || p_row[j] == T(0)) ds_row[j] = T(0);
            }
          }
          if (Dv > 0) {  // dV += Pᵀ·dO
            gemm(Transpose::kYes, Transpose::kNo, nt, Dv, mt, T(1), p.data() + h * P, stride, dO, Dv, T(1),
                 dv + ((b * H + h) * N + n0) * Dv, Dv);
          }
        }
        te_logits_backward(pr.mlp, x.data(), ds.data(), dfeat.data(), P, grads, scratch.data());
        if (D > 0) {
          for (int64_t h = 0; h < H; ++h) {  // the dot products' gradients, times the scale, to q and k
            gemm(Transpose::kNo, Transpose::kNo, mt, D, nt, pr.scale, dfeat.data() + h * P, stride,
                 pr.k_rows(b, h, n0), D, T(1), dq + ((b * H + h) * M + m0) * D, D);
            gemm(Transpose::kYes, Transpose::kNo, nt, D, mt, pr.scale, dfeat.data() + h * P, stride,
                 pr.q_rows(b, h, m0), D, T(1), dk + ((b * H + h) * N + n0) * D, D);
          }
        }
        for (int64_t d = 0; d < dx; ++d) {  // the differences' gradients: + to the query, − to the key
          const T* rows = dfeat.data() + (H + d) * P;
          for (int64_t i = 0; i < mt; ++i) {
            const T* row = rows + i * stride;
            T s = 0;
            for (int64_t j = 0; j < nt; ++j) {
              s += row[j];
              dxk[(b * N + n0 + j) * dx + d] -= row[j];
            }
            dxq[(b * M + m0 + i) * dx + d] += s;
          }
        }
      }
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
te_attention_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const at::Tensor& xq, const at::Tensor& xk, const at::Tensor& w1,
                     const at::Tensor& b1, const at::Tensor& w2, const at::Tensor& b2,
                     const std::optional<at::Tensor>& key_padding_mask, const at::Tensor& out, const at::Tensor& lse,
                     double scale, int64_t activation, int64_t chunk_size) {
  const TeAttentionShape s =
      check_te_attention_inputs(q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask, scale, activation, chunk_size);
  check_te_attention_grads(s, q, grad_out, grad_lse, out, lse);
  const TeInputs in =
      prepare_te_inputs(q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask, scale, activation, chunk_size, s);
  const at::ScalarType acc = in.q.scalar_type();
  const at::TensorOptions options = q.options().dtype(acc);
  const at::Tensor dO = grad_out.to(acc).contiguous();
  const at::Tensor delta = ((dO * out.to(acc)).sum(-1) - grad_lse).contiguous();
  const at::Tensor lse_c = lse.contiguous();
  const int64_t threads = at::get_num_threads(), hp = in.hidden_padded, F = s.H + s.dx;
  at::Tensor dk = at::zeros({s.B, s.H, s.N, s.D}, options), dv = at::zeros({s.B, s.H, s.N, s.Dv}, options);
  at::Tensor dxk = at::zeros({s.B, s.N, s.dx}, options);
  at::Tensor dq, dxq, dw1, db1, dw2t, db2;
  auto run = [&](auto zero) {
    using T = decltype(zero);
    ThreadSums sums{at::zeros({threads, s.B, s.H, s.M, s.D}, options), at::zeros({threads, s.B, s.M, s.dx}, options),
                       at::zeros({threads, hp, F}, options), at::zeros({threads, hp}, options),
                       at::zeros({threads, hp, s.H}, options), at::zeros({threads, s.H}, options)};
    te_backward(TeProblem<T>(in), in.tile_keys, dO.data_ptr<T>(), delta.data_ptr<T>(), lse_c.data_ptr<T>(), sums,
                dk.data_ptr<T>(), dv.data_ptr<T>(), dxk.data_ptr<T>());
    dq = sums.dq.sum(0);
    dxq = sums.dxq.sum(0);
    dw1 = sums.dw1.sum(0).narrow(0, 0, s.hidden);
    db1 = sums.db1.sum(0).narrow(0, 0, s.hidden);
    dw2t = sums.dw2t.sum(0).narrow(0, 0, s.hidden);
    db2 = sums.db2.sum(0);
  };
  if (acc == at::kDouble) {
    run(double(0));
  } else {
    run(float(0));
  }
  if (key_padding_mask.has_value()) {  // a padded key was never read: its rows get no gradient, whatever dO held
    const at::Tensor mask = *key_padding_mask;
    dk.masked_fill_(mask.view({s.B, 1, s.N, 1}), 0);
    dv.masked_fill_(mask.view({s.B, 1, s.N, 1}), 0);
    dxk.masked_fill_(mask.view({s.B, s.N, 1}), 0);
  }
  auto as = [](const at::Tensor& g, const at::Tensor& like) { return g.to(like.scalar_type()).contiguous(); };
  return {as(dq, q),  as(dk, k),           as(dv, v),  as(dxq, xq), as(dxk, xk),
          as(dw1, w1), as(db1, b1), as(dw2t.t(), w2), as(db2, b2)};
}

}  // namespace attn_ext::cpu
