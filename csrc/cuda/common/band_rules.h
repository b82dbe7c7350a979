// The causal rule and a sliding window as the kernels take them (AttentionMaskLayout's causal flag and band),
// from the op's arguments: one place for the bindings and the host emulation tests.
//
// Plain C++ (no CUDA or torch headers), like the plans.
#pragma once

#include <algorithm>
#include <cstdint>

#include "attention_mask.h"

namespace attn_ext {
namespace cuda {

/// The band of `is_causal` and window (left, right) (−1: unbounded side) about the diagonal key m + diagonal
/// of query m, for M queries and N keys. The top-left causal rule alone stays `causal` (the kernels' split
/// loops); any other band is made as the CPU kernels' (lo = diagonal − left, hi = diagonal or diagonal +
/// right), each side without effect for these M and N made unbounded (no per-pair test for it) and the
/// others clamped to [−M, N] (no overflow in m + lo).
inline void fill_band(AttentionMaskLayout& p, bool is_causal, int64_t window_left, int64_t window_right,
                      int64_t diagonal, int64_t M, int64_t N) {
  const bool windowed = window_left >= 0 || window_right >= 0;
  p.diagonal = diagonal;
  if (is_causal && !windowed && diagonal == 0) {
    p.causal = true;
  } else if (is_causal || windowed) {
    int64_t lo = -kBandUnbounded, hi = kBandUnbounded;
    if (window_left >= 0) lo = diagonal - window_left;
    if (is_causal) hi = diagonal;
    if (window_right >= 0) hi = std::min(hi, diagonal + window_right);
    p.band_lo = lo <= 1 - M ? -kBandUnbounded : std::min(lo, N);  // n >= m + lo for every n >= 0, m < M
    p.band_hi = hi >= N - 1 ? kBandUnbounded : std::max(hi, -M);  // n <= m + hi for every n < N, m >= 0
  }
}

/// The same for a packed batch (common/packed_sequences.h) whose longest sequence has max_q queries and max_k
/// keys: the sides are relative to each sequence's diagonal (the kernels add its shift, N_s − M_s when
/// bottom_right, to the bounded sides). A side without effect for any sequence is made unbounded (for every
/// m < M_s ≤ max_q and shift in [−max_q, max_k]); the others are clamped to [−(max_q + max_k), max_q + max_k],
/// which keeps every m + side + shift far inside int64.
inline void fill_packed_band(AttentionMaskLayout& p, bool is_causal, int64_t window_left, int64_t window_right,
                             bool bottom_right, int64_t max_q, int64_t max_k) {
  const bool windowed = window_left >= 0 || window_right >= 0;
  p.diagonal = 0;
  if (is_causal && !windowed && !bottom_right) {
    p.causal = true;
    return;
  }
  if (!is_causal && !windowed) return;
  const int64_t far = max_q + max_k;
  int64_t lo = -kBandUnbounded, hi = kBandUnbounded;
  if (window_left >= 0) lo = -std::min(window_left, far);
  if (is_causal) hi = 0;
  if (window_right >= 0) hi = std::min(hi, std::min(window_right, far));
  p.band_lo = lo <= -far ? -kBandUnbounded : lo;
  p.band_hi = hi >= far ? kBandUnbounded : hi;
}

}  // namespace cuda
}  // namespace attn_ext
