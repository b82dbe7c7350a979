// Row products of the CPU tree kernels: a query row kept in the accumulation type against a node's
// key or value row in the input type, upcast element by element (the rows are too short and too
// scattered over the node arrays for a BLAS call to pay).
#pragma once

#include <cstdint>

namespace attn_ext::cpu {

/// Σ_d q[d]·k[d].
template <typename scalar_t, typename acc_t>
inline acc_t dot(const acc_t* q, const scalar_t* k, int64_t D) {
  acc_t s = acc_t(0);
  for (int64_t d = 0; d < D; ++d) s += q[d] * static_cast<acc_t>(k[d]);
  return s;
}

/// y += alpha·x.
template <typename scalar_t, typename acc_t>
inline void axpy(acc_t alpha, const scalar_t* x, acc_t* y, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] += alpha * static_cast<acc_t>(x[d]);
}

}  // namespace attn_ext::cpu
