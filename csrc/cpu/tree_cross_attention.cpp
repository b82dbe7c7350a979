// CPU forward of Tree Cross Attention (docs/spec.md §3 "Retrieve" + "Attend"), fused per query.
//
// One work item is one query (b, m) of the B·M queries (at::parallel_for); the heads are looped
// inside, because the policy averages them. From the root, each level scores the b children of the
// current node for every head, takes the step of attn_ext/tree_descent.h (policy, choice, log π,
// entropy), folds the b − 1 rejected valid children into one online-softmax row per head
// (attn_ext/online_softmax.h) and moves to the chosen child; at the group level the P leaves of the
// chosen group are folded in. Only the node ids (`selected`, the path the backward and REINFORCE
// need) are written besides the outputs; no selected-set keys/values are gathered.
//
// Non-finite inputs (docs/tree.md, "NaN and infinity"), detected without extra passes: a NaN step of
// the descent leaves log π NaN, and the whole query's outputs are then NaN; a NaN or +inf attention
// score leaves a head's running sum NaN, and all valid scores −inf leave it 0 although a valid node
// was read: either way that head's out and lse are NaN. NaN values reach `out` through the sums.
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

template <typename scalar_t>
void tree_forward_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const bool* mask,
                         const at::Tensor& uniforms, const TreeShape& s, double scale_d, at::Tensor& out,
                         at::Tensor& lse, at::Tensor& selected, at::Tensor& log_prob, at::Tensor& entropy) {
  using acc_t = acc_type<scalar_t>;
  const acc_t scale = static_cast<acc_t>(scale_d);
  const int64_t B = s.batch, H = s.heads, M = s.queries, D = s.head_dim, Dv = s.value_dim, NN = s.nodes;
  const int64_t b = s.branching, P = s.group_size, S = s.selected;
  const bool sample = uniforms.defined();
  const scalar_t* q_data = q.const_data_ptr<scalar_t>();
  const scalar_t* k_data = k.const_data_ptr<scalar_t>();
  const scalar_t* v_data = v.const_data_ptr<scalar_t>();
  const acc_t* u_data = sample ? uniforms.const_data_ptr<acc_t>() : nullptr;
  scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
  acc_t* lse_data = lse.mutable_data_ptr<acc_t>();
  int64_t* sel_data = selected.mutable_data_ptr<int64_t>();
  acc_t* lp_data = log_prob.mutable_data_ptr<acc_t>();
  acc_t* ent_data = entropy.mutable_data_ptr<acc_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const int64_t block = std::max(b, P);
  const int64_t cost = H * S * (D + Dv) + H * b * D;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(cost, 1));

  at::parallel_for(0, B * M, grain, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> q_row(H * D), child_scores(H * b), scores(H * block), acc(H * Dv), pi(b);
    std::vector<OnlineSoftmaxRow<acc_t>> rows(H);
    // bool buffers (std::vector<bool> has no data()): padding of the b children, and of a fold block.
    std::unique_ptr<bool[]> cp(new bool[b]), child_pad(new bool[block]);
    std::vector<int64_t> ids(block);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t bi = unit / M, m = unit % M;
      for (int64_t h = 0; h < H; ++h) {
        const scalar_t* src = q_data + bi * qs0 + h * qs1 + m * qs2;
        for (int64_t d = 0; d < D; ++d) q_row[h * D + d] = static_cast<acc_t>(src[d]);
      }
      std::fill(acc.begin(), acc.end(), acc_t(0));
      std::fill(rows.begin(), rows.end(), online_softmax_empty<acc_t>());
      const bool* mask_row = mask + bi * NN;
      int64_t* sel = sel_data + unit * S;
      const scalar_t* k_base = k_data + bi * ks0;
      const scalar_t* v_base = v_data + bi * vs0;

      // Folds `count` keys (ids[0..count), their scores scores[h * block + j], padding child_pad[j])
      // into every head's online-softmax row as one block. Only a block without valid keys is
      // skipped: one whose valid scores are −inf or NaN still adds its exp(s − shift), 0 or NaN, and
      // its values (0·NaN = NaN), so that non-finite inputs reach the row as in torch.softmax.
      bool seen_valid = false;
      auto fold = [&](int64_t count) {
        bool any_valid = false;
        for (int64_t j = 0; j < count; ++j) any_valid = any_valid || !child_pad[j];
        if (!any_valid) return;
        seen_valid = true;
        for (int64_t h = 0; h < H; ++h) {
          acc_t* sc = scores.data() + h * block;
          acc_t block_max = negative_infinity<acc_t>();
          for (int64_t j = 0; j < count; ++j) {
            if (!child_pad[j] && sc[j] > block_max) block_max = sc[j];
          }
          OnlineSoftmaxRow<acc_t>& row = rows[h];
          const acc_t factor = online_softmax_advance(row, block_max);
          acc_t* a = acc.data() + h * Dv;
          if (factor != acc_t(1)) {
            for (int64_t d = 0; d < Dv; ++d) a[d] *= factor;
          }
          const acc_t shift = online_softmax_shift(row);
          for (int64_t j = 0; j < count; ++j) {
            if (child_pad[j]) continue;
            const acc_t p = math_exp(sc[j] - shift);
            row.sum += p;
            const scalar_t* vv = v_base + h * vs1 + ids[j] * vs2;
            for (int64_t d = 0; d < Dv; ++d) a[d] += p * static_cast<acc_t>(vv[d]);
          }
        }
      };

      int64_t node = 0, written = 0;
      acc_t lp = acc_t(0), ent = acc_t(0);
      for (int64_t level = 0; level < s.height; ++level) {
        const int64_t first = node * b + 1;
        for (int64_t c = 0; c < b; ++c) cp[c] = mask_row[first + c];
        for (int64_t h = 0; h < H; ++h) {
          const scalar_t* kh = k_base + h * ks1;
          for (int64_t c = 0; c < b; ++c) {
            child_scores[h * b + c] = cp[c] ? negative_infinity<acc_t>()
                                      : dot<scalar_t, acc_t>(q_row.data() + h * D, kh + (first + c) * ks2, D) * scale;
          }
        }
        const acc_t u = sample ? u_data[unit * s.height + level] : acc_t(0);
        const TreeStep<acc_t> step = tree_descent_step(child_scores.data(), H, static_cast<int>(b), cp.get(), sample, u, pi.data());
        lp += step.log_prob;
        ent += step.entropy;
        // Compact the rejected children (and their scores, per head) to the front of the block.
        int64_t j = 0;
        for (int64_t c = 0; c < b; ++c) {
          if (c == step.choice) continue;
          ids[j] = first + c;
          child_pad[j] = cp[c];
          for (int64_t h = 0; h < H; ++h) scores[h * block + j] = child_scores[h * b + c];
          ++j;
        }
        fold(j);
        for (int64_t t = 0; t < j; ++t) sel[written++] = ids[t];
        node = first + step.choice;
      }

      const int64_t group = node - s.group_offset;
      const int64_t leaf0 = s.leaf_offset + group * P;
      for (int64_t j = 0; j < P; ++j) {
        ids[j] = leaf0 + j;
        child_pad[j] = mask_row[leaf0 + j];
      }
      for (int64_t h = 0; h < H; ++h) {
        const scalar_t* kh = k_base + h * ks1;
        for (int64_t j = 0; j < P; ++j) {
          scores[h * block + j] = child_pad[j] ? negative_infinity<acc_t>()
                                               : dot<scalar_t, acc_t>(q_row.data() + h * D, kh + ids[j] * ks2, D) * scale;
        }
      }
      fold(P);
      for (int64_t j = 0; j < P; ++j) sel[written++] = ids[j];

      const bool descent_nan = std::isnan(lp);  // some step's policy was NaN (tree_descent_step)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t row = (bi * H + h) * M + m;
        // A row that read a valid node has sum >= 1 (its largest score contributes exp(0)) unless a
        // score was NaN or +inf (sum NaN) or all were −inf (sum 0).
        if (descent_nan || (seen_valid && !(rows[h].sum > acc_t(0)))) {
          std::fill(out_data + row * Dv, out_data + (row + 1) * Dv, static_cast<scalar_t>(tree_nan<acc_t>()));
          lse_data[row] = tree_nan<acc_t>();
          continue;
        }
        const OnlineSoftmaxResult<acc_t> done = online_softmax_finish(rows[h]);
        for (int64_t d = 0; d < Dv; ++d) out_data[row * Dv + d] = static_cast<scalar_t>(acc[h * Dv + d] * done.inv_sum);
        lse_data[row] = done.lse;
      }
      lp_data[unit] = lp;
      ent_data[unit] = ent;
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> tree_cross_attention_fwd_cpu(
    const at::Tensor& q, const at::Tensor& node_k, const at::Tensor& node_v, const at::Tensor& node_padding_mask,
    int64_t branching, int64_t height, int64_t group_size, double scale, const std::optional<at::Tensor>& uniforms) {
  const TreeShape s =
      check_tree_inputs(q, node_k, node_v, node_padding_mask, branching, height, group_size, scale, uniforms);
  TORCH_CHECK(q.device().is_cpu(), "attn_ext: the CPU kernel got tensors on ", q.device());
  const at::Tensor qc = with_unit_inner_stride(q);
  const at::Tensor kc = with_unit_inner_stride(node_k);
  const at::Tensor vc = with_unit_inner_stride(node_v);
  const at::Tensor mask = node_padding_mask.contiguous();
  const at::ScalarType acc_dtype = accumulation_dtype(q.scalar_type());
  at::Tensor u;
  if (uniforms.has_value()) u = uniforms->to(acc_dtype).contiguous();
  at::Tensor out = at::empty({s.batch, s.heads, s.queries, s.value_dim}, q.options());
  at::Tensor lse = at::empty({s.batch, s.heads, s.queries}, q.options().dtype(acc_dtype));
  at::Tensor selected = at::empty({s.batch, s.queries, s.selected}, q.options().dtype(at::kLong));
  at::Tensor log_prob = at::empty({s.batch, s.queries}, q.options().dtype(acc_dtype));
  at::Tensor entropy = at::empty({s.batch, s.queries}, q.options().dtype(acc_dtype));
  if (s.batch * s.queries == 0) return {out, lse, selected, log_prob, entropy};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "attn_ext::tree_cross_attention_fwd", [&] {
    tree_forward_kernel<scalar_t>(qc, kc, vc, mask.const_data_ptr<bool>(), u, s, scale, out, lse, selected, log_prob,
                                  entropy);
  });
  return {out, lse, selected, log_prob, entropy};
}

}  // namespace attn_ext::cpu
