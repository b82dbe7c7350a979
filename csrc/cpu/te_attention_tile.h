// What the forward and backward of translation-equivariant attention share: the call's tensors converted to the
// accumulation dtype with padded keys' rows zeroed (TeInputs), the raw view the loops read (TeProblem), the tile
// sizes, and the staging of one tile's MLP features (every head's scaled dot products, then the input differences).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>

#include "blas.h"
#include "checks/te_attention_checks.h"
#include "te_attention_mlp.h"

namespace attn_ext::cpu {

/// Queries per tile. With 64 keys a tile holds 1,024 pairs: its features, logits and their gradients stay in L2 while
/// each register block of hidden units streams over them, and the attention products are GEMMs big enough for BLAS.
constexpr int64_t kTeTileQueries = 16;
constexpr int64_t kTeTileKeys = 64;

/// The tensors the loops read, contiguous in the accumulation dtype; a padded key's k, v and xk rows are zero, so
/// that whatever it held (NaN) reaches no product, and the MLP's hidden units padded to a multiple of kTeUnits.
struct TeInputs {
  at::Tensor q, k, v, xq, xk, w1, b1, w2t, b2;
  std::optional<at::Tensor> key_padding;  // bool [B, N], contiguous
  TeAttentionShape shape;
  int64_t hidden_padded;
  TeActivation activation;
  double scale;
  int64_t tile_keys;
};

inline TeInputs prepare_te_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& xq,
                                  const at::Tensor& xk, const at::Tensor& w1, const at::Tensor& b1,
                                  const at::Tensor& w2, const at::Tensor& b2,
                                  const std::optional<at::Tensor>& key_padding_mask, double scale, int64_t activation,
                                  int64_t chunk_size, const TeAttentionShape& s) {
  const at::ScalarType acc = accumulation_dtype(q.scalar_type());
  auto convert = [acc](const at::Tensor& t) { return t.to(acc).contiguous(); };
  TeInputs in;
  in.shape = s;
  in.q = convert(q);
  in.k = convert(k);
  in.v = convert(v);
  in.xq = convert(xq);
  in.xk = convert(xk);
  if (key_padding_mask.has_value()) {
    const at::Tensor mask = key_padding_mask->contiguous();
    in.key_padding = mask;
    in.k = in.k.masked_fill(mask.view({s.B, 1, s.N, 1}), 0);
    in.v = in.v.masked_fill(mask.view({s.B, 1, s.N, 1}), 0);
    in.xk = in.xk.masked_fill(mask.view({s.B, s.N, 1}), 0);
  }
  in.hidden_padded = (s.hidden + kTeUnits - 1) / kTeUnits * kTeUnits;
  const int64_t pad = in.hidden_padded - s.hidden;
  in.w1 = at::constant_pad_nd(w1.to(acc), {0, 0, 0, pad}).contiguous();
  in.b1 = at::constant_pad_nd(b1.to(acc), {0, pad}).contiguous();
  in.w2t = at::constant_pad_nd(w2.to(acc).t(), {0, 0, 0, pad}).contiguous();
  in.b2 = convert(b2);
  in.activation = static_cast<TeActivation>(activation);
  in.scale = scale;
  in.tile_keys = chunk_size > 0 ? chunk_size : kTeTileKeys;
  return in;
}

/// Raw pointers into TeInputs for element type T (float or double).
template <typename T>
struct TeProblem {
  const T *q, *k, *v, *xq, *xk;
  const bool* key_padding;  // nullptr: none
  int64_t B, H, M, N, D, Dv, dx;
  T scale;
  TeMlp<T> mlp;

  explicit TeProblem(const TeInputs& in)
      : q(in.q.data_ptr<T>()), k(in.k.data_ptr<T>()), v(in.v.data_ptr<T>()), xq(in.xq.data_ptr<T>()),
        xk(in.xk.data_ptr<T>()), key_padding(in.key_padding ? in.key_padding->data_ptr<bool>() : nullptr),
        B(in.shape.B), H(in.shape.H), M(in.shape.M), N(in.shape.N), D(in.shape.D), Dv(in.shape.Dv), dx(in.shape.dx),
        scale(static_cast<T>(in.scale)),
        mlp{in.w1.data_ptr<T>(), in.b1.data_ptr<T>(), in.w2t.data_ptr<T>(), in.b2.data_ptr<T>(), in.shape.H + in.shape.dx,
            in.shape.H, in.hidden_padded, in.activation} {}

  const T* q_rows(int64_t b, int64_t h, int64_t m0) const { return q + ((b * H + h) * M + m0) * D; }
  const T* k_rows(int64_t b, int64_t h, int64_t n0) const { return k + ((b * H + h) * N + n0) * D; }
  const T* v_rows(int64_t b, int64_t h, int64_t n0) const { return v + ((b * H + h) * N + n0) * Dv; }
  bool padded(int64_t b, int64_t n) const { return key_padding != nullptr && key_padding[b * N + n]; }
};

/// The pair stride of a tile of `keys` keys: pairs (i, j) sit at i·stride + j, j < keys, the rest zero.
inline int64_t te_pair_stride(int64_t keys) { return (keys + kTePairAlign - 1) / kTePairAlign * kTePairAlign; }

/// x [F][mt·stride] ← the features of the pairs of queries m0..m0+mt and keys n0..n0+nt of batch entry b: rows
/// 0..H-1 scale·q_i·k_j of each head, rows H.. xq_i − xk_j (the difference first, so that a common shift of xq and xk
/// cancels before any product); pairs past nt are zero.
template <typename T>
void stage_te_features(const TeProblem<T>& pr, int64_t b, int64_t m0, int64_t mt, int64_t n0, int64_t nt, T* x) {
  const int64_t stride = te_pair_stride(nt), P = mt * stride;
  for (int64_t h = 0; h < pr.H; ++h) {
    T* rows = x + h * P;
    if (pr.D == 0) {
      std::fill(rows, rows + P, T(0));
    } else {
      gemm(Transpose::kNo, Transpose::kYes, mt, nt, pr.D, pr.scale, pr.q_rows(b, h, m0), pr.D, pr.k_rows(b, h, n0),
           pr.D, T(0), rows, stride);
    }
  }
  for (int64_t d = 0; d < pr.dx; ++d) {
    T* rows = x + (pr.H + d) * P;
    const T* xk = pr.xk + (b * pr.N + n0) * pr.dx + d;
    for (int64_t i = 0; i < mt; ++i) {
      const T xq = pr.xq[(b * pr.M + m0 + i) * pr.dx + d];
      T* row = rows + i * stride;
      for (int64_t j = 0; j < nt; ++j) row[j] = xq - xk[j * pr.dx];
    }
  }
  if (nt < stride) {
    for (int64_t f = 0; f < pr.H + pr.dx; ++f) {
      for (int64_t i = 0; i < mt; ++i) std::fill(x + f * P + i * stride + nt, x + f * P + (i + 1) * stride, T(0));
    }
  }
}

}  // namespace attn_ext::cpu
