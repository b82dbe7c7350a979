// Per-step math of the Tree Cross Attention descent (docs/spec.md §3 "Retrieve"), shared by the CPU kernel
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
//
// Non-finite scores (docs/tree.md, "NaN and infinity"): the policy is computed as torch.softmax would,
// so a NaN or +inf score of a valid child, or a head whose valid children all score −inf, makes π NaN.
// Such a step cannot choose: it follows the first valid child (so that `selected` stays a path of valid
// nodes, identically on every backend) and reports log π = entropy = NaN, which the kernels turn into
// NaN outputs for the whole query.
//
// Backward (the choices are constants; REINFORCE differentiates log π and the entropy): with upstream
// gradients g_lp of Σ_t log π(a_t) and g_H of Σ_t H(π_t),
//     dπ_c = g_lp·[c = a]/π_a − g_H·(log π_c + 1)   for π_c > 0,   0 where π_c = 0,
// each head's weights get dw_c = dπ_c / H (the mean), and its logits dl_c = w_c (dw_c − Σ_c' w_c' dw_c').
#pragma once

#include <stdint.h>

#include "attn_ext/macros.h"

namespace attn_ext {

/// Outcome of one descent step of one query.
template <typename acc_t>
struct TreeStep {
  int choice;      ///< index in [0, b) of the chosen child
  acc_t log_prob;  ///< log π(choice); −inf only if no child is valid (a malformed mask), NaN if π is NaN
  acc_t entropy;   ///< −Σ_c π_c log π_c over the children with π_c > 0; NaN if π is NaN
};

template <typename acc_t>
ATTN_EXT_HOST_DEVICE acc_t tree_nan() {
  return static_cast<acc_t>(NAN);
}

/// Head-averaged policy over the `b` children of one node for one query.
///
/// `scores` holds `heads × b` scaled scores, head-major (`scores[h * b + c]`); entries of padding
/// children are ignored (they may hold anything). `child_padding[c]` is true for a padding child.
/// Writes `pi[c]` (0 for padding children). If no child is valid every π is 0; a non-finite score
/// of a valid child makes π NaN as in torch.softmax (see the file comment).
template <typename acc_t>
ATTN_EXT_HOST_DEVICE void tree_policy(const acc_t* scores, int64_t heads, int b, const bool* child_padding,
                                      acc_t* pi) {
  for (int c = 0; c < b; ++c) pi[c] = acc_t(0);
  for (int64_t h = 0; h < heads; ++h) {
    const acc_t* s = scores + h * b;
    acc_t mx = negative_infinity<acc_t>();
    bool any_valid = false;
    for (int c = 0; c < b; ++c) {
      any_valid = any_valid || !child_padding[c];
      if (!child_padding[c] && s[c] > mx) mx = s[c];
    }
    // No valid child: contributes nothing. Otherwise a NaN score gives exp(NaN − mx) = NaN, +inf gives
    // exp(inf − inf), and valid scores all −inf (or NaN) give exp(−inf − (−inf)): π NaN, as torch.softmax.
    if (!any_valid) continue;
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

/// Entropy −Σ_c π_c log π_c of a policy, terms with π_c = 0 contributing exactly 0; NaN if π is.
template <typename acc_t>
ATTN_EXT_HOST_DEVICE acc_t tree_policy_entropy(const acc_t* pi, int b) {
  acc_t sum = acc_t(0);
  for (int c = 0; c < b; ++c) {
    if (!(pi[c] <= acc_t(0))) sum += pi[c] * math_log(pi[c]);  // a NaN π_c is summed, not skipped
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
  // The entropy is NaN exactly when π is (π ∈ [0, 1] otherwise): then the choice above compared NaN
  // and means nothing. Testing the entropy rather than scanning π again keeps the CUDA kernel's
  // registers where they were (a separate scan cost the fp32 forward ~30 registers on sm_90).
  if (step.entropy != step.entropy) {
    int first_valid = 0;
    while (first_valid < b - 1 && child_padding[first_valid]) ++first_valid;
    step.choice = first_valid;
    step.log_prob = tree_nan<acc_t>();
  }
  return step;
}

/// Gradient of one step's `log π(choice)` and entropy with respect to every head's child weights:
/// writes `dw[c] = dπ_c / heads` (the same for all heads, since π is their mean). See the file comment.
template <typename acc_t>
ATTN_EXT_HOST_DEVICE void tree_policy_backward(const acc_t* pi, int b, int choice, acc_t grad_log_prob,
                                               acc_t grad_entropy, int64_t heads, acc_t* dw) {
  const acc_t inv_heads = acc_t(1) / static_cast<acc_t>(heads);
  for (int c = 0; c < b; ++c) {
    acc_t d = acc_t(0);
    if (pi[c] > acc_t(0)) {
      d = -grad_entropy * (math_log(pi[c]) + acc_t(1));
      if (c == choice) d += grad_log_prob / pi[c];
    }
    dw[c] = d * inv_heads;
  }
}

/// One head's softmax weights `w` over the children (0 for padding children) from its `scores`
/// (`b` entries, padding ones ignored), as in tree_policy.
template <typename acc_t>
ATTN_EXT_HOST_DEVICE void tree_head_weights(const acc_t* scores, int b, const bool* child_padding, acc_t* w) {
  acc_t mx = negative_infinity<acc_t>();
  for (int c = 0; c < b; ++c) {
    if (!child_padding[c] && scores[c] > mx) mx = scores[c];
  }
  acc_t sum = acc_t(0);
  for (int c = 0; c < b; ++c) {
    w[c] = (child_padding[c] || is_negative_infinity(mx)) ? acc_t(0) : math_exp(scores[c] - mx);
    sum += w[c];
  }
  for (int c = 0; c < b; ++c) w[c] = sum > acc_t(0) ? w[c] / sum : acc_t(0);
}

/// Softmax backward of one head's child weights: `dl[c] = w_c (dw_c − Σ_c' w_c' dw_c')`, the
/// gradient of its (scaled) child scores.
template <typename acc_t>
ATTN_EXT_HOST_DEVICE void tree_head_logit_backward(const acc_t* w, const acc_t* dw, int b, acc_t* dl) {
  acc_t mean = acc_t(0);
  for (int c = 0; c < b; ++c) mean += w[c] * dw[c];
  for (int c = 0; c < b; ++c) dl[c] = w[c] * (dw[c] - mean);
}

/// The descent path of a query, read back from the id of the first leaf of its chosen group (the
/// first of the last `group_size` entries of its selected set): `path[0] = 0` (root) … `path[height]`
/// (the group node). Ids follow attn_ext/tree/build.py (heap layout, leaves after the groups).
ATTN_EXT_HOST_DEVICE void tree_path_from_leaf(int64_t first_leaf, int64_t branching, int64_t height,
                                                     int64_t group_size, int64_t group_offset, int64_t leaf_offset,
                                                     int64_t* path) {
  path[height] = group_offset + (first_leaf - leaf_offset) / group_size;
  for (int64_t t = height; t > 0; --t) path[t - 1] = (path[t] - 1) / branching;
}

}  // namespace attn_ext
