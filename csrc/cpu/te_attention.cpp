// te_attention_fwd on the CPU (csrc/op_list.h): per (batch entry, tile of kTeTileQueries queries), the keys a tile at
// a time: stage the pairs' features, run the MLP over them (te_attention_mlp.h), then one online softmax per head and
// the value sum by GEMM. Holds per thread one tile's features and logits and the tile's running (max, sum, output):
// nothing of size M·N.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops.h"
#include "te_attention_tile.h"
#include "vectorized_rows.h"

namespace attn_ext::cpu {

namespace {

template <typename T>
void te_forward(const TeProblem<T>& pr, int64_t tile_keys, T* out, T* lse) {
  const int64_t H = pr.H, M = pr.M, Dv = pr.Dv, F = pr.mlp.features;
  const int64_t mt_max = std::min(kTeTileQueries, M), tn_max = std::min(tile_keys, std::max<int64_t>(pr.N, 1));
  const int64_t P_max = mt_max * te_pair_stride(tn_max);
  const int64_t tiles_m = (M + kTeTileQueries - 1) / kTeTileQueries;
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  at::parallel_for(0, pr.B * tiles_m, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> x(F * P_max), logits(H * P_max), acc(H * mt_max * Dv), run_max(H * mt_max), run_sum(H * mt_max);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / tiles_m, m0 = item % tiles_m * kTeTileQueries, mt = std::min(kTeTileQueries, M - m0);
      std::fill(acc.begin(), acc.end(), T(0));
      std::fill(run_max.begin(), run_max.end(), kNegInf);
      std::fill(run_sum.begin(), run_sum.end(), T(0));
      for (int64_t n0 = 0; n0 < pr.N; n0 += tile_keys) {
        const int64_t nt = std::min(tile_keys, pr.N - n0), stride = te_pair_stride(nt), P = mt * stride;
        stage_te_features(pr, b, m0, mt, n0, nt, x.data());
        te_logits(pr.mlp, x.data(), logits.data(), P);
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t i = 0; i < mt; ++i) {
            T* row = logits.data() + h * P + i * stride;
            if (pr.key_padding != nullptr) {
              for (int64_t j = 0; j < nt; ++j) {
                if (pr.padded(b, n0 + j)) row[j] = kNegInf;
              }
            }
            const int64_t r = h * mt_max + i;
            const T new_max = std::max(run_max[r], row_max(row, nt));
            if (new_max == kNegInf) {  // no key yet: nothing to add, and −inf − −inf must not meet an exp
              // ... unless the row's logits are NaN (row_max passes over NaN): then the row's result is NaN.
              if (std::any_of(row, row + nt, [](T s) { return std::isnan(s); })) {
                run_max[r] = run_sum[r] = std::numeric_limits<T>::quiet_NaN();
              }
              std::fill(row, row + nt, T(0));
              continue;
            }
            const T factor = std::exp(run_max[r] - new_max);  // 0 while the row had no key
            run_sum[r] = run_sum[r] * factor + exp_shifted_inplace_sum(row, nt, new_max);
            run_max[r] = new_max;
            T* acc_row = acc.data() + r * Dv;
            for (int64_t d = 0; d < Dv; ++d) acc_row[d] *= factor;
          }
          if (Dv > 0) {
            gemm(Transpose::kNo, Transpose::kNo, mt, Dv, nt, T(1), logits.data() + h * P, stride,
                 pr.v_rows(b, h, n0), Dv, T(1), acc.data() + h * mt_max * Dv, Dv);
          }
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t i = 0; i < mt; ++i) {
          const int64_t r = h * mt_max + i, row = (b * H + h) * M + m0 + i;
          const bool empty = run_sum[r] == T(0);
          lse[row] = empty ? kNegInf : run_max[r] + std::log(run_sum[r]);
          const T inv = empty ? T(0) : T(1) / run_sum[r];
          for (int64_t d = 0; d < Dv; ++d) out[row * Dv + d] = acc[r * Dv + d] * inv;
        }
      }
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> te_attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                        const at::Tensor& xq, const at::Tensor& xk,
                                                        const at::Tensor& w1, const at::Tensor& b1,
                                                        const at::Tensor& w2, const at::Tensor& b2,
                                                        const std::optional<at::Tensor>& key_padding_mask,
                                                        double scale, int64_t activation, int64_t chunk_size) {
  const TeAttentionShape s =
      check_te_attention_inputs(q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask, scale, activation, chunk_size);
  const TeInputs in =
      prepare_te_inputs(q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask, scale, activation, chunk_size, s);
  const at::ScalarType acc = in.q.scalar_type();
  at::Tensor out = at::empty({s.B, s.H, s.M, s.Dv}, q.options().dtype(acc));
  at::Tensor lse = at::empty({s.B, s.H, s.M}, q.options().dtype(acc));
  if (acc == at::kDouble) {
    te_forward(TeProblem<double>(in), in.tile_keys, out.data_ptr<double>(), lse.data_ptr<double>());
  } else {
    te_forward(TeProblem<float>(in), in.tile_keys, out.data_ptr<float>(), lse.data_ptr<float>());
  }
  return {out.to(q.scalar_type()), lse};
}

}  // namespace attn_ext::cpu
