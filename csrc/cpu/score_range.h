// The check that a CPU attention forward never returns a silently wrong row because a scaled score,
// or the accumulation of values, left the range of the accumulation dtype (docs/sdpa.md, "Scores out of
// range"): scale = 1e38 with fp32 inputs, or q·k beyond 3.4e38, has a finite fp64 answer that fp32
// cannot compute. Such a row shows in the results the kernel already wrote:
//
//  * a score of +inf makes the online softmax's max +inf, so lse and out are NaN (or lse +inf);
//  * every allowed score of the row at −inf makes it look like a row with no key: out 0, lse −inf;
//  * an lse beyond the dtype's range is +inf although out is right (the backward would need it);
//  * values near the dtype's maximum can overflow the weighted sum: out inf or NaN.
//
// Each of these is also what the NaN rule gives for non-finite inputs or a row with no allowed key. The
// kernel's stores (store_tile, merge_partial_states) report whether they wrote a value that is not
// finite, at the cost of a compare on values already in registers; only then are the rows examined: a
// row that is not finite, has an allowed key, and whose inputs are all finite (its query, and the keys,
// values and additive mask entries of its allowed pairs) is an overflow, and the call raises.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "attention_kernels.h"
#include "attention_masking.h"
#include "checks/common.h"

namespace attn_ext::cpu {
namespace score_range {

template <typename T>
bool finite_row(const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(static_cast<double>(x[i]))) return false;
  }
  return true;
}

template <typename scalar_t>
const scalar_t* row_at(const at::Tensor& t, int64_t b, int64_t h, int64_t row) {
  return t.const_data_ptr<scalar_t>() + b * t.stride(0) + h * t.stride(1) + row * t.stride(2);
}

/// Whether query row m of (b, h) has an allowed key, and whether all inputs of its allowed pairs are finite.
template <typename scalar_t, typename Plane>
void examine_row(const AttentionCall& call, const PairRule<Plane>& rule, int64_t b, int64_t h, int64_t hkv, int64_t m,
                 bool* has_key, bool* inputs_finite) {
  const int64_t N = kv_rows(call), D = call.q.size(3), Dv = call.v.size(3);
  *has_key = false;
  *inputs_finite = finite_row(row_at<scalar_t>(call.q, b, h, m), D);
  for (int64_t n = 0; n < N; ++n) {
    if (!pair_allowed(rule, m, n)) continue;
    *has_key = true;
    if constexpr (kAdditiveMask<Plane>) {
      const auto bias = rule.mask.data[m * rule.mask.row_stride + n * rule.mask.col_stride];
      *inputs_finite = *inputs_finite && std::isfinite(static_cast<double>(bias));
    }
    *inputs_finite = *inputs_finite && finite_row(kv_row<scalar_t>(call, call.k, b, hkv, n), D) &&
                     finite_row(kv_row<scalar_t>(call, call.v, b, hkv, n), Dv);
    if (!*inputs_finite) return;
  }
}

/// What the row would have returned, for the error message.
inline const char* symptom(double lse) {
  if (std::isnan(lse)) return "NaN";
  if (lse == HUGE_VAL) return "an lse of +inf";
  if (lse == -HUGE_VAL) return "0 with lse = -inf, as for a row with no key";
  return "an output of inf or NaN";  // a finite lse: the row's weighted sum of values overflowed
}

}  // namespace score_range

/// Whether every lse and out value of row `row` is finite.
template <typename scalar_t, typename acc_t>
bool row_finite(const acc_t* lse, const scalar_t* out, int64_t Dv, int64_t row) {
  return std::isfinite(static_cast<double>(lse[row])) && score_range::finite_row(out + row * Dv, Dv);
}

/// Raises (naming call.op) for the first query row whose out or lse is an overflow (see above). Called
/// only when the kernel's stores found a value that is not finite (store_tile's result).
template <typename scalar_t, typename Plane>
void check_scores_in_range(const AttentionCall& call, const at::Tensor& out, const at::Tensor& lse) {
  using acc_t = acc_type<scalar_t>;
  const int64_t B = out.size(0), Hq = out.size(1), M = out.size(2), Dv = out.size(3), Hkv = kv_heads(call);
  const int64_t rows = B * Hq * M;
  const std::vector<Segment> segments = call_segments(call);
  const acc_t* lse_data = lse.const_data_ptr<acc_t>();
  const scalar_t* out_data = out.const_data_ptr<scalar_t>();  // contiguous
  for (int64_t row = 0; row < rows; ++row) {
    const acc_t l = lse_data[row];
    if (row_finite(lse_data, out_data, Dv, row)) continue;
    const int64_t m = row % M, h = (row / M) % Hq, b = row / (M * Hq);
    // A packed batch's segments are its sequences (by query row); otherwise one per batch entry (a paged cache's too).
    const int64_t segment = segment_of(segments, !call.packed.empty() && !call.block_table.defined(), b, m);
    if (segment >= static_cast<int64_t>(segments.size())) continue;  // a row of no packed sequence: none
    const PairRule<Plane> rule = pair_rule<Plane>(call, segments, segment, h);
    bool has_key = false, inputs_finite = false;
    score_range::examine_row<scalar_t>(call, rule, b, h, h / (Hq / Hkv), m, &has_key, &inputs_finite);
    if (!has_key || !inputs_finite) continue;  // a row with no key (0, −inf), or the NaN rule
    TORCH_CHECK_VALUE(false, call.op, ": the scores or values of query row [batch, head, query] = [", b, ", ", h, ", ",
                      m, "] leave the range of ", lse.scalar_type() == at::kDouble ? "float64" : "float32",
                      " (|scale · q·k|, the row's lse or its weighted sum of values beyond ",
                      std::numeric_limits<acc_t>::max(), "; scale = ", call.scale,
                      ") although its inputs are finite: the result would be ",
                      score_range::symptom(static_cast<double>(l)),
                      ". Pass a smaller scale, smaller inputs, or float64 inputs");
  }
}

}  // namespace attn_ext::cpu
