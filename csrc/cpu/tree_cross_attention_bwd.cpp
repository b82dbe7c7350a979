// CPU backward of Tree Cross Attention (docs/spec.md §3): gradients of (out, lse, log_prob, entropy) with
// respect to q, node_k and node_v, given the selected sets the forward returned.
//
// The descent's choices are constants; what is differentiated is the attention over each query's
// selected set S and, along its path, the policies behind log π and the entropy. Two passes, no
// atomics, bit-identical run to run:
//  1. per query (parallel over B·M): rebuild the path from S, recompute the head-averaged policy at
//     each level and keep dw = dπ/H per (level, child) — the only thing that couples the heads;
//  2. per (batch, head) (parallel over B·H): for its queries in order, the child-softmax backward
//     with that dw, and the attention backward over S (P = exp(s − lse), Δ = Σ_j P_j dP_j,
//     dS = P (dP − Δ + dlse)). dq rows are owned; dk/dv of the (batch, head) slice are only touched
//     by this work item, so they accumulate without races in a fixed order.
// Cost O(M·H·(height·b + |S|)·(D + Dv)); memory O(B·M·height·b) besides the gradients.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <tuple>
#include <vector>

#include "attn_ext/online_softmax.h"
#include "attn_ext/tree_descent.h"
#include "checks/common.h"
#include "checks/tree_checks.h"
#include "ops.h"
#include "tree_rows.h"

namespace attn_ext::cpu {
namespace {

/// Inputs of one backward call, as raw pointers and strides (last dims contiguous).
template <typename scalar_t, typename acc_t>
struct TreeBackwardArgs {
  const scalar_t *q, *k, *v, *grad_out;
  const acc_t *grad_lse, *grad_log_prob, *grad_entropy, *lse;
  const bool* mask;
  const int64_t* selected;
  int64_t qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2;
  acc_t scale;
};

/// Pass 1: dw [B·M, height, b] (dπ/H along each query's path); returns false if all of it is 0.
template <typename scalar_t, typename acc_t>
bool policy_weight_grads(const TreeBackwardArgs<scalar_t, acc_t>& a, const TreeShape& s, acc_t* dw) {
  const int64_t B = s.batch, H = s.heads, M = s.queries, D = s.head_dim, NN = s.nodes, b = s.branching;
  const int64_t k = s.height, S = s.selected, P = s.group_size;
  bool any = false;
  for (int64_t unit = 0; unit < B * M && !any; ++unit) {
    any = a.grad_log_prob[unit] != acc_t(0) || a.grad_entropy[unit] != acc_t(0);
  }
  if (!any || k == 0) return false;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(H * k * b * D, 1));
  at::parallel_for(0, B * M, grain, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> q_row(H * D), scores(H * b), pi(b);
    std::vector<int64_t> path(k + 1);
    std::unique_ptr<bool[]> child_pad(new bool[b]);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t bi = unit / M, m = unit % M;
      acc_t* dw_unit = dw + unit * k * b;
      const acc_t glp = a.grad_log_prob[unit], gent = a.grad_entropy[unit];
      if (glp == acc_t(0) && gent == acc_t(0)) {
        std::fill(dw_unit, dw_unit + k * b, acc_t(0));
        continue;
      }
      for (int64_t h = 0; h < H; ++h) {
        const scalar_t* src = a.q + bi * a.qs0 + h * a.qs1 + m * a.qs2;
        for (int64_t d = 0; d < D; ++d) q_row[h * D + d] = static_cast<acc_t>(src[d]);
      }
      tree_path_from_leaf(a.selected[unit * S + S - P], b, k, P, s.group_offset, s.leaf_offset, path.data());
      const bool* mask_row = a.mask + bi * NN;
      for (int64_t t = 0; t < k; ++t) {
        const int64_t first = path[t] * b + 1;
        for (int64_t c = 0; c < b; ++c) child_pad[c] = mask_row[first + c];
        for (int64_t h = 0; h < H; ++h) {
          const scalar_t* kh = a.k + bi * a.ks0 + h * a.ks1;
          for (int64_t c = 0; c < b; ++c) {
            scores[h * b + c] = child_pad[c] ? negative_infinity<acc_t>()
                                             : dot<scalar_t, acc_t>(&q_row[h * D], kh + (first + c) * a.ks2, D) * a.scale;
          }
        }
        tree_policy(scores.data(), H, static_cast<int>(b), child_pad.get(), pi.data());
        tree_policy_backward(pi.data(), static_cast<int>(b), static_cast<int>(path[t + 1] - first), glp, gent, H,
                             dw_unit + t * b);
      }
    }
  });
  return true;
}

/// Pass 2 for one (batch, head): dq rows of its queries, and its dk/dv slices (acc dtype, zeroed).
template <typename scalar_t, typename acc_t>
void head_backward(const TreeBackwardArgs<scalar_t, acc_t>& a, const TreeShape& s, const acc_t* dw, int64_t bi,
                   int64_t h, scalar_t* dq, acc_t* dk, acc_t* dv) {
  const int64_t H = s.heads, M = s.queries, D = s.head_dim, Dv = s.value_dim, NN = s.nodes, b = s.branching;
  const int64_t k = s.height, S = s.selected, P = s.group_size;
  const scalar_t* kh = a.k + bi * a.ks0 + h * a.ks1;
  const scalar_t* vh = a.v + bi * a.vs0 + h * a.vs1;
  const bool* mask_row = a.mask + bi * NN;
  std::vector<acc_t> q_row(D), dq_row(D), do_row(Dv), prob(S), dprob(S), scores(b), w(b), dl(b);
  std::vector<int64_t> path(k + 1);
  std::unique_ptr<bool[]> child_pad(new bool[b]);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t unit = bi * M + m, row = (bi * H + h) * M + m;
    const scalar_t* q_src = a.q + bi * a.qs0 + h * a.qs1 + m * a.qs2;
    for (int64_t d = 0; d < D; ++d) q_row[d] = static_cast<acc_t>(q_src[d]);
    for (int64_t d = 0; d < Dv; ++d) do_row[d] = static_cast<acc_t>(a.grad_out[row * Dv + d]);
    std::fill(dq_row.begin(), dq_row.end(), acc_t(0));
    const int64_t* sel = a.selected + unit * S;

    if (dw != nullptr) {  // policy terms along the path
      tree_path_from_leaf(sel[S - P], b, k, P, s.group_offset, s.leaf_offset, path.data());
      for (int64_t t = 0; t < k; ++t) {
        const int64_t first = path[t] * b + 1;
        for (int64_t c = 0; c < b; ++c) {
          child_pad[c] = mask_row[first + c];
          scores[c] = child_pad[c] ? negative_infinity<acc_t>()
                                   : dot<scalar_t, acc_t>(q_row.data(), kh + (first + c) * a.ks2, D) * a.scale;
        }
        tree_head_weights(scores.data(), static_cast<int>(b), child_pad.get(), w.data());
        tree_head_logit_backward(w.data(), dw + (unit * k + t) * b, static_cast<int>(b), dl.data());
        for (int64_t c = 0; c < b; ++c) {
          if (dl[c] == acc_t(0)) continue;
          const acc_t g = dl[c] * a.scale;
          axpy<scalar_t, acc_t>(g, kh + (first + c) * a.ks2, dq_row.data(), D);
          acc_t* dk_c = dk + (first + c) * D;
          for (int64_t d = 0; d < D; ++d) dk_c[d] += g * q_row[d];
        }
      }
    }

    // Attention over S: P_j = exp(s_j − lse); an empty row (lse = −inf) has no gradient.
    const acc_t lse = a.lse[row];
    if (!is_negative_infinity(lse)) {
      acc_t delta = acc_t(0);
      for (int64_t j = 0; j < S; ++j) {
        const int64_t id = sel[j];
        if (mask_row[id]) {
          prob[j] = dprob[j] = acc_t(0);
          continue;
        }
        prob[j] = math_exp(dot<scalar_t, acc_t>(q_row.data(), kh + id * a.ks2, D) * a.scale - lse);
        dprob[j] = dot<scalar_t, acc_t>(do_row.data(), vh + id * a.vs2, Dv);
        delta += prob[j] * dprob[j];
      }
      const acc_t glse = a.grad_lse[row];
      for (int64_t j = 0; j < S; ++j) {
        if (prob[j] == acc_t(0)) continue;
        const int64_t id = sel[j];
        const acc_t ds = prob[j] * (dprob[j] - delta + glse) * a.scale;
        axpy<scalar_t, acc_t>(ds, kh + id * a.ks2, dq_row.data(), D);
        acc_t* dk_j = dk + id * D;
        for (int64_t d = 0; d < D; ++d) dk_j[d] += ds * q_row[d];
        acc_t* dv_j = dv + id * Dv;
        for (int64_t d = 0; d < Dv; ++d) dv_j[d] += prob[j] * do_row[d];
      }
    }
    for (int64_t d = 0; d < D; ++d) dq[row * D + d] = static_cast<scalar_t>(dq_row[d]);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_cross_attention_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& grad_log_prob,
    const at::Tensor& grad_entropy, const at::Tensor& q, const at::Tensor& node_k, const at::Tensor& node_v,
    const at::Tensor& node_padding_mask, const at::Tensor& selected, const at::Tensor& lse, int64_t branching,
    int64_t height, int64_t group_size, double scale) {
  const TreeShape s =
      check_tree_inputs(q, node_k, node_v, node_padding_mask, branching, height, group_size, scale, std::nullopt);
  TORCH_CHECK(q.device().is_cpu(), "attn_ext: the CPU kernel got tensors on ", q.device());
  check_tree_bwd_inputs(s, grad_out, grad_lse, grad_log_prob, grad_entropy, selected, lse);
  const at::ScalarType acc_dtype = accumulation_dtype(q.scalar_type());
  auto as_acc = [&](const at::Tensor& t) { return t.to(acc_dtype).contiguous(); };
  const at::Tensor qc = with_unit_inner_stride(q);
  const at::Tensor kc = with_unit_inner_stride(node_k);
  const at::Tensor vc = with_unit_inner_stride(node_v);
  const at::Tensor go = grad_out.to(q.scalar_type()).contiguous(), mask = node_padding_mask.contiguous();
  const at::Tensor sel = selected.contiguous(), lse_c = as_acc(lse), glse = as_acc(grad_lse);
  const at::Tensor glp = as_acc(grad_log_prob), gent = as_acc(grad_entropy);
  at::Tensor dq = at::empty({s.batch, s.heads, s.queries, s.head_dim}, q.options());
  at::Tensor dk = at::zeros({s.batch, s.heads, s.nodes, s.head_dim}, q.options().dtype(acc_dtype));
  at::Tensor dv = at::zeros({s.batch, s.heads, s.nodes, s.value_dim}, q.options().dtype(acc_dtype));
  if (s.batch * s.heads * s.queries > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "attn_ext::tree_cross_attention_bwd", [&] {
      using acc_t = acc_type<scalar_t>;
      TreeBackwardArgs<scalar_t, acc_t> a{qc.const_data_ptr<scalar_t>(), kc.const_data_ptr<scalar_t>(),
                                          vc.const_data_ptr<scalar_t>(), go.const_data_ptr<scalar_t>(),
                                          glse.const_data_ptr<acc_t>(), glp.const_data_ptr<acc_t>(),
                                          gent.const_data_ptr<acc_t>(), lse_c.const_data_ptr<acc_t>(),
                                          mask.const_data_ptr<bool>(), sel.const_data_ptr<int64_t>(),
                                          qc.stride(0), qc.stride(1), qc.stride(2), kc.stride(0), kc.stride(1),
                                          kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
                                          static_cast<acc_t>(scale)};
      std::vector<acc_t> dw(static_cast<size_t>(s.batch * s.queries * std::max<int64_t>(s.height, 1) * s.branching));
      const bool has_policy_grad = policy_weight_grads(a, s, dw.data());
      scalar_t* dq_data = dq.mutable_data_ptr<scalar_t>();
      acc_t* dk_data = dk.mutable_data_ptr<acc_t>();
      acc_t* dv_data = dv.mutable_data_ptr<acc_t>();
      at::parallel_for(0, s.batch * s.heads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t bh = begin; bh < end; ++bh) {
          head_backward(a, s, has_policy_grad ? dw.data() : nullptr, bh / s.heads, bh % s.heads, dq_data,
                        dk_data + bh * s.nodes * s.head_dim, dv_data + bh * s.nodes * s.value_dim);
        }
      });
    });
  } else {
    dq.zero_();
  }
  return {dq, dk.to(q.scalar_type()), dv.to(q.scalar_type())};
}

}  // namespace attn_ext::cpu
