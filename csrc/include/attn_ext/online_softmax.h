// Per-row online-softmax and attention-state math (docs/spec.md §1), shared by the CPU and CUDA kernels.
//
// A query row's attention over the keys seen so far is kept either
//  * unnormalised, while a kernel streams key blocks: a running maximum `max`, the sum
//    `sum = Σ exp(s_i − max)` and an accumulator `acc = Σ exp(s_i − max) v_i` kept by the caller; or
//  * normalised, as a state `(o, lse)` with `lse = log Σ exp(s_i)` and `o = Σ exp(s_i − lse) v_i`,
//    which is what the ops return and what merges across key splits, chunks and ranks.
// The empty row (no key seen, or every key padded) is `max = −inf, sum = 0` / `o = 0, lse = −inf`;
// every function below keeps it free of `(−inf) − (−inf)` so that it never produces NaN.
//
// NaN is never turned into that marker (docs/cross_attention.md, "NaN, inf and empty rows"): a NaN
// score (or +inf − +inf) makes `exp` NaN, so the row's `sum` and the caller's accumulator turn NaN
// and stay NaN through every later rescale (NaN · 0 = NaN); the finish step then reports NaN rather
// than "empty". The maxima may drop NaN (fmaxf does, `a > b ? a : b` does): the sum does not, so
// the check costs nothing in the streaming loop, once per row at the end.
#pragma once

#include "attn_ext/macros.h"

namespace attn_ext {

/// Running statistics of one query row in a streaming pass over key blocks.
template <typename acc_t>
struct OnlineSoftmaxRow {
  acc_t max;  ///< largest score seen so far (−inf while nothing valid was seen)
  acc_t sum;  ///< Σ exp(s_i − max) over the keys seen so far
};

template <typename acc_t>
ATTN_EXT_HOST_DEVICE OnlineSoftmaxRow<acc_t> online_softmax_empty() {
  return OnlineSoftmaxRow<acc_t>{negative_infinity<acc_t>(), acc_t(0)};
}

/// Moves the row's maximum to account for a new block whose largest score is `block_max`.
///
/// Returns the factor by which the caller must multiply its accumulator (the row's own `sum` is
/// rescaled here). After the call, the block's probabilities are `exp(s − online_softmax_shift(row))`
/// and their sum is added to `row.sum`.
template <typename acc_t>
ATTN_EXT_HOST_DEVICE acc_t online_softmax_advance(OnlineSoftmaxRow<acc_t>& row, acc_t block_max) {
  const acc_t new_max = block_max > row.max ? block_max : row.max;
  if (is_negative_infinity(new_max)) {
    return acc_t(1);  // still nothing valid: sum and accumulator are zero and stay so
  }
  const acc_t factor = is_negative_infinity(row.max) ? acc_t(0) : math_exp(row.max - new_max);
  row.max = new_max;
  row.sum *= factor;
  return factor;
}

/// The value subtracted from scores before exponentiating. An empty row shifts by 0 so that
/// masked scores (−inf) give exp(−inf) = 0 instead of exp(NaN).
template <typename acc_t>
ATTN_EXT_HOST_DEVICE acc_t online_softmax_shift(const OnlineSoftmaxRow<acc_t>& row) {
  return is_negative_infinity(row.max) ? acc_t(0) : row.max;
}

/// Normalisation of a finished row: `out = acc * inv_sum`, and the row's log-sum-exp.
template <typename acc_t>
struct OnlineSoftmaxResult {
  acc_t lse;      ///< natural-log log-sum-exp of the row's scores, −inf for an empty row
  acc_t inv_sum;  ///< 1 / sum, or 0 for an empty row so that its output is exactly 0
};

/// A row none of whose keys carries weight has `sum = 0`: every key padded (or none), or every
/// score −inf. exp(−inf) = 0 is an exact zero weight, as for a padded key, so that row is the empty
/// state (lse −inf, inv_sum 0, out exactly 0), the same whether its keys came in one pass or in
/// merged parts. A NaN sum (a NaN score, or +inf − +inf) is no such row: NaN lse and inv_sum.
template <typename acc_t>
ATTN_EXT_HOST_DEVICE OnlineSoftmaxResult<acc_t> online_softmax_finish(const OnlineSoftmaxRow<acc_t>& row) {
  if (row.sum == acc_t(0)) {
    return OnlineSoftmaxResult<acc_t>{negative_infinity<acc_t>(), acc_t(0)};
  }
  if (!(row.sum > acc_t(0))) {
    return OnlineSoftmaxResult<acc_t>{quiet_nan<acc_t>(), quiet_nan<acc_t>()};
  }
  return OnlineSoftmaxResult<acc_t>{row.max + math_log(row.sum), acc_t(1) / row.sum};
}

/// Weights that merge two normalised states over disjoint key sets:
/// `lse = logaddexp(lse_a, lse_b)`, `o = weight_a·o_a + weight_b·o_b`.
template <typename acc_t>
struct StateMergeWeights {
  acc_t lse;
  acc_t weight_a;
  acc_t weight_b;
};

/// A NaN lse on either side makes `rest`, hence the lse and both weights, NaN (every comparison
/// below is false for NaN, and exp/log1p propagate it), so out = w_a·o_a + w_b·o_b is NaN too: a
/// NaN state poisons any merge. The empty state (lse −inf) gets weight exactly 0 and the other side
/// weight exactly 1 and its lse unchanged; NaN in the empty side's out still shows (0 · NaN = NaN).
template <typename acc_t>
ATTN_EXT_HOST_DEVICE StateMergeWeights<acc_t> state_merge_weights(acc_t lse_a, acc_t lse_b) {
  if (is_negative_infinity(lse_a) && is_negative_infinity(lse_b)) {
    return StateMergeWeights<acc_t>{negative_infinity<acc_t>(), acc_t(0), acc_t(0)};
  }
  // Factor out the larger term so the exponent is ≤ 0: exact for the identity (−inf) and no overflow.
  const acc_t hi = lse_a > lse_b ? lse_a : lse_b;
  const acc_t lo = lse_a > lse_b ? lse_b : lse_a;
  const acc_t rest = math_exp(lo - hi);  // exp(−inf) = 0 when one side is empty
  const acc_t lse = hi + math_log1p(rest);
  const acc_t weight_hi = acc_t(1) / (acc_t(1) + rest);
  const acc_t weight_lo = rest * weight_hi;
  return lse_a > lse_b ? StateMergeWeights<acc_t>{lse, weight_hi, weight_lo}
                       : StateMergeWeights<acc_t>{lse, weight_lo, weight_hi};
}

/// The attention probability of a key given the row's final log-sum-exp, as the backward pass
/// recomputes it: `exp(s − lse)`, and 0 for an empty row (lse = −inf) instead of exp(NaN). A NaN
/// row (lse NaN) gives NaN, so its gradients are NaN; callers zero padded keys' gradients themselves.
template <typename acc_t>
ATTN_EXT_HOST_DEVICE acc_t softmax_probability(acc_t score, acc_t lse) {
  return is_negative_infinity(lse) ? acc_t(0) : math_exp(score - lse);
}

/// The score gradient of one (query, key) pair (docs/spec.md §1 backward):
/// `dS = P·(dO·v − Δ + dlse)` with `Δ = dO·o` of the query row.
template <typename acc_t>
ATTN_EXT_HOST_DEVICE acc_t score_gradient(acc_t probability, acc_t grad_probability, acc_t delta,
                                          acc_t grad_lse) {
  return probability * (grad_probability - delta + grad_lse);
}

}  // namespace attn_ext
