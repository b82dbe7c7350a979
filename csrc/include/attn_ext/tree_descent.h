// Per-step math of the Tree Cross Attention descent (SPEC §3 "Retrieve"), shared by the CPU kernel
// (csrc/cpu/tree_cross_attention.cpp) and a future CUDA kernel.
//
// At a node with `b` children a query has, for every head h, the scores `s[h][c] = scale·q_h·k_{h,c}`.
// The policy is the head average of the per-head softmax over the *valid* children:
//     π(c) = (1/H) Σ_h softmax_{c valid}(s[h][·])_c ,   π(c) = 0 for a padding child,
// exactly as attn_ext/tree/retrieval.py computes it (softmax with the row max subtracted, then the
// mean over heads). The step then chooses a child:
//  * greedy: the argmax of π, ties to the first child (torch.argmax);
//  * sample: inverse CDF on a uniform u ∈ [0, 1): with the running sums cdf_c = π_0 + … + π_c, the
//    choice is #{c : cdf_c ≤ u·cdf_{b−1}} (capped at b − 1). A child with π = 0 is never chosen, since
//    a chosen c has cdf_c > cdf_{c−1}. The reference draws the same way from the same uniforms.
// and reports log π(choice) and the step's entropy −Σ_c π_c log π_c (0·log 0 = 0).
#pragma once

#include <stdint.h>

#include "attn_ext/macros.h"

namespace attn_ext {

/// Outcome of one descent step of one query.
template <typename acc_t>
struct TreeStep {
  int choice;      ///< index in [0, b) of the chosen child
  acc_t log_prob;  ///< log π(choice); −inf only if no child is valid (a malformed mask)
  acc_t entropy;   ///< −Σ_c π_c log π_c over the children with π_c > 0
};

/// Head-averaged policy over the `b` children of one node for one query.
///
/// `scores` holds `heads × b` scaled scores, head-major (`scores[h * b + c]`); entries of padding
/// children are ignored (they may hold anything). `child_padding[c]` is true for a padding child.
/// Writes `pi[c]` (0 for padding children). If no child is valid every π is 0.
template <typename acc_t>
ATTN_EXT_HOST_DEVICE void tree_policy(const acc_t* scores, int64_t heads, int b, const bool* child_padding,
                                      acc_t* pi) {
  for (int c = 0; c < b; ++c) pi[c] = acc_t(0);
  for (int64_t h = 0; h < heads; ++h) {
    const acc_t* s = scores + h * b;
    acc_t mx = negative_infinity<acc_t>();
    for (int c = 0; c < b; ++c) {
      if (!child_padding[c] && s[c] > mx) mx = s[c];
    }
    if (is_negative_infinity(mx)) continue;  // no valid child (or all scores −inf): contributes nothing
    acc_t sum = acc_t(0);
    for (int c = 0; c < b; ++c) {
      if (!child_padding[c]) sum += math_exp(s[c] - mx);
    }
    for (int c = 0; c < b; ++c) {
      if (!child_padding[c]) pi[c] += math_exp(s[c] - mx) / sum;
    }
  }
  for (int c = 0; c < b; ++c) pi[c] = pi[c] / static_cast<acc_t>(heads);  // as torch.mean: sum, then divide
}

/// The chosen child: argmax of π (first on ties) when `sample` is false, else the inverse-CDF draw
/// of the uniform `u ∈ [0, 1)` (see the file comment).
template <typename acc_t>
ATTN_EXT_HOST_DEVICE int tree_choose(const acc_t* pi, int b, bool sample, acc_t u) {
  if (!sample) {
    int best = 0;
    for (int c = 1; c < b; ++c) {
      if (pi[c] > pi[best]) best = c;
    }
    return best;
  }
  // Running sums in double, each prefix rounded to acc_t: what torch.cumsum does on CPU, so that the
  // reference draws the same child from the same u (the choice is exact up to ties at the boundaries).
  double running = 0.0;
  for (int c = 0; c < b; ++c) running += static_cast<double>(pi[c]);
  const acc_t threshold = u * static_cast<acc_t>(running);
  running = 0.0;
  int count = 0;
  for (int c = 0; c < b; ++c) {
    running += static_cast<double>(pi[c]);
    count += static_cast<acc_t>(running) <= threshold ? 1 : 0;
  }
  return count < b ? count : b - 1;
}

/// Entropy −Σ_c π_c log π_c of a policy, terms with π_c = 0 contributing exactly 0.
template <typename acc_t>
ATTN_EXT_HOST_DEVICE acc_t tree_policy_entropy(const acc_t* pi, int b) {
  acc_t sum = acc_t(0);
  for (int c = 0; c < b; ++c) {
    if (pi[c] > acc_t(0)) sum += pi[c] * math_log(pi[c]);
  }
  return -sum;
}

/// One full descent step: policy (written to `pi`, `b` entries), choice, log π(choice) and entropy.
template <typename acc_t>
ATTN_EXT_HOST_DEVICE TreeStep<acc_t> tree_descent_step(const acc_t* scores, int64_t heads, int b,
                                                      const bool* child_padding, bool sample, acc_t u, acc_t* pi) {
  tree_policy(scores, heads, b, child_padding, pi);
  TreeStep<acc_t> step;
  step.choice = tree_choose(pi, b, sample, u);
  step.log_prob = pi[step.choice] > acc_t(0) ? math_log(pi[step.choice]) : negative_infinity<acc_t>();
  step.entropy = tree_policy_entropy(pi, b);
  return step;
}

}  // namespace attn_ext
