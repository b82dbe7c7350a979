// CPU merge of two attention states over disjoint key sets (docs/spec.md §1 merge) and its backward.
// One pass over the rows, OpenMP over rows; the per-row weights come from the shared header.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <tuple>

#include "attn_ext/online_softmax.h"
#include "checks/attention_checks.h"
#include "ops.h"

namespace attn_ext::cpu {
namespace {

// A merge is a few flops per element: below ~64K elements waking other threads costs more than it.
constexpr int64_t kElementsPerTask = int64_t(1) << 16;

int64_t rows_per_task(int64_t dv) { return std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(dv, 1)); }

}  // namespace

std::tuple<at::Tensor, at::Tensor> merge_states_fwd_cpu(const at::Tensor& out_a, const at::Tensor& lse_a,
                                                        const at::Tensor& out_b, const at::Tensor& lse_b) {
  const MergeStateRows s = check_merge_states(out_a, lse_a, out_b, lse_b);
  const at::Tensor oa = out_a.contiguous(), ob = out_b.contiguous(), la = lse_a.contiguous(), lb = lse_b.contiguous();
  at::Tensor out = at::empty_like(oa);
  at::Tensor lse = at::empty_like(la);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "attn_ext::merge_states_fwd", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t *pa = oa.const_data_ptr<scalar_t>(), *pb = ob.const_data_ptr<scalar_t>();
    const acc_t *pla = la.const_data_ptr<acc_t>(), *plb = lb.const_data_ptr<acc_t>();
    scalar_t* po = out.mutable_data_ptr<scalar_t>();
    acc_t* pl = lse.mutable_data_ptr<acc_t>();
    at::parallel_for(0, s.rows, rows_per_task(s.dv), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const StateMergeWeights<acc_t> w = state_merge_weights(pla[row], plb[row]);
        for (int64_t d = 0; d < s.dv; ++d) {
          const int64_t i = row * s.dv + d;
          po[i] = static_cast<scalar_t>(w.weight_a * static_cast<acc_t>(pa[i]) + w.weight_b * static_cast<acc_t>(pb[i]));
        }
        pl[row] = w.lse;
      }
    });
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> merge_states_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& out_a, const at::Tensor& lse_a,
    const at::Tensor& out_b, const at::Tensor& lse_b, const at::Tensor& out, const at::Tensor& lse) {
  const MergeStateRows s = check_merge_states(out_a, lse_a, out_b, lse_b);
  check_merge_states_grads(grad_out, grad_lse, out, lse, out_a, lse_a);
  const at::Tensor g = grad_out.contiguous(), gl = grad_lse.contiguous(), oa = out_a.contiguous(),
                   ob = out_b.contiguous(), la = lse_a.contiguous(), lb = lse_b.contiguous(), o = out.contiguous(),
                   l = lse.contiguous();
  at::Tensor grad_out_a = at::empty_like(oa), grad_out_b = at::empty_like(ob);
  at::Tensor grad_lse_a = at::empty_like(la), grad_lse_b = at::empty_like(lb);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, oa.scalar_type(), "attn_ext::merge_states_bwd", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t *pg = g.const_data_ptr<scalar_t>(), *pa = oa.const_data_ptr<scalar_t>(),
                   *pb = ob.const_data_ptr<scalar_t>(), *po = o.const_data_ptr<scalar_t>();
    const acc_t *pgl = gl.const_data_ptr<acc_t>(), *pla = la.const_data_ptr<acc_t>(), *plb = lb.const_data_ptr<acc_t>(),
                *pl = l.const_data_ptr<acc_t>();
    scalar_t *pga = grad_out_a.mutable_data_ptr<scalar_t>(), *pgb = grad_out_b.mutable_data_ptr<scalar_t>();
    acc_t *pgla = grad_lse_a.mutable_data_ptr<acc_t>(), *pglb = grad_lse_b.mutable_data_ptr<acc_t>();
    at::parallel_for(0, s.rows, rows_per_task(s.dv), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        // w = exp(lse_x − lse): the share of the merged softmax mass that came from side x.
        const acc_t wa = softmax_probability(pla[row], pl[row]);
        const acc_t wb = softmax_probability(plb[row], pl[row]);
        acc_t dot_a = 0, dot_b = 0;
        for (int64_t d = 0; d < s.dv; ++d) {
          const int64_t i = row * s.dv + d;
          const acc_t gi = static_cast<acc_t>(pg[i]), oi = static_cast<acc_t>(po[i]);
          dot_a += gi * (static_cast<acc_t>(pa[i]) - oi);
          dot_b += gi * (static_cast<acc_t>(pb[i]) - oi);
          pga[i] = static_cast<scalar_t>(wa * gi);
          pgb[i] = static_cast<scalar_t>(wb * gi);
        }
        pgla[row] = wa * (dot_a + pgl[row]);
        pglb[row] = wb * (dot_b + pgl[row]);
      }
    });
  });
  return {grad_out_a, grad_lse_a, grad_out_b, grad_lse_b};
}

}  // namespace attn_ext::cpu
