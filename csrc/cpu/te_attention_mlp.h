// The MLP ρ of translation-equivariant attention over one tile of (query, key) pairs, forward and pull-back: the
// op's flops (per pair and hidden unit, (H + dx) + H multiply-adds forward, about three times that backward, against
// H·(D + Dv) for the attention products), so its loops are compiled once per instruction set (te_attention_mlp.cpp)
// and keep four hidden units' activations in registers while the pairs stream through as vectors.
//
// A tile holds P pairs (P a multiple of kTePairAlign) in feature-major layout: features x [F][P] with F = H + dx
// (rows 0..H-1 the heads' scaled dot products, rows H.. the input differences), logits [H][P].
#pragma once

#include <cstdint>

#include "attn_ext/te_activation.h"

namespace attn_ext::cpu {

/// The pairs of a tile come in multiples of this (the widest vector of float or double lanes).
constexpr int64_t kTePairAlign = 16;
/// Hidden units per register block; TeMlp's hidden count is a multiple of it.
constexpr int64_t kTeUnits = 4;

/// ρ's weights, laid out for the loops: hidden units padded to a multiple of kTeUnits with zero weights in and out
/// (a padded unit's activation is act(0) = 0 for every activation, and its outgoing weights are 0 anyway).
template <typename T>
struct TeMlp {
  const T* w1;   ///< [hidden][F]
  const T* b1;   ///< [hidden]
  const T* w2t;  ///< [hidden][H]: W2 transposed, a unit's outgoing weights side by side
  const T* b2;   ///< [H]
  int64_t features, heads, hidden;
  TeActivation activation;
};

/// Per-thread sums of ρ's weight gradients, in the layout of TeMlp.
template <typename T>
struct TeMlpGrads {
  T* w1;   ///< [hidden][F]
  T* b1;   ///< [hidden]
  T* w2t;  ///< [hidden][H]
  T* b2;   ///< [H]
};

/// Numbers of T scratch that te_logits_backward needs for `mlp`.
int64_t te_backward_scratch_size(int64_t features, int64_t heads);

/// logits[h][p] = b2[h] + Σ_c w2[h][c] act(b1[c] + Σ_f w1[c][f] x[f][p]), p < P.
void te_logits(const TeMlp<float>& mlp, const float* x, float* logits, int64_t P);
void te_logits(const TeMlp<double>& mlp, const double* x, double* logits, int64_t P);

/// The pull-back of te_logits: dx [F][P] ← ∂/∂x of Σ dlogits ∘ logits, and the weight gradients added to `grads`.
/// A pair with dlogits 0 in every head adds nothing (padding pairs: give them 0).
void te_logits_backward(const TeMlp<float>& mlp, const float* x, const float* dlogits, float* dx, int64_t P,
                        const TeMlpGrads<float>& grads, float* scratch);
void te_logits_backward(const TeMlp<double>& mlp, const double* x, const double* dlogits, double* dx, int64_t P,
                        const TeMlpGrads<double>& grads, double* scratch);

}  // namespace attn_ext::cpu
