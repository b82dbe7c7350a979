// The soft cap c·tanh(s / c) of a score (Gemma 2, Grok), with the tanh every GPU kernel of the library computes:
// from one exp and, near 0, its odd series, as the Triton kernels do (attn_ext/ops/attention/triton_score_mod.py's
// tanh_f32). CUDA's tanhf inlined into the attention kernels' per-pair loops cost registers enough to spill
// (the mma.sync forward at D = 128: 8 -> 32 bytes of stack on sm_80), as does an IEEE division (a subroutine call in
// device code); this form costs an exp, a fast division (its operands lie in [0, 2]) and a few FMAs. Within a few
// ulp of tanh everywhere; ±inf gives ±1, NaN stays NaN.
//
// Host and device (ATTN_EXT_HOST_DEVICE), torch-free: the CUDA kernels and their host emulation include it.
#pragma once

#include "attn_ext/macros.h"

namespace attn_ext {

/// tanh(x) in float: (1 − e)/(1 + e), e = exp(−2|x|), which loses 1 − e to cancellation near 0, where the series to
/// x¹¹ is used (|x| < 1/4: its first omitted term is below 2·10⁻¹⁰ relative).
ATTN_EXT_HOST_DEVICE float tanh_from_exp(float x) {
  const float a = fabsf(x);
  float r;
  if (a < 0.25f) {
    const float a2 = a * a;
    r = a * (1.0f + a2 * (-1.0f / 3.0f + a2 * (2.0f / 15.0f + a2 * (-17.0f / 315.0f +
                                                                  a2 * (62.0f / 2835.0f + a2 * (-1382.0f / 155925.0f))))));
  } else {
    const float e = math_exp(-2.0f * a);
    r = math_fast_divide(1.0f - e, 1.0f + e);
  }
  return x < 0.0f ? -r : r;
}

}  // namespace attn_ext
