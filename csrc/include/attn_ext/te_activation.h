// The activations of translation-equivariant attention's MLP ρ (csrc/op_list.h, te_attention_fwd) and their
// derivatives, per element: what torch.relu, torch.nn.functional.gelu (the erf form), silu and tanh compute, so that
// the fused kernels agree with a PyTorch model of the same MLP. The op's `activation` argument is the enum's value.
//
// Host and device (ATTN_EXT_HOST_DEVICE), torch-free.
#pragma once

#include <stdint.h>

#include "attn_ext/macros.h"

namespace attn_ext {

enum class TeActivation : int64_t { kRelu = 0, kGelu = 1, kSilu = 2, kTanh = 3 };

constexpr int64_t kTeActivationCount = 4;

/// act(x).
template <typename T>
ATTN_EXT_HOST_DEVICE T te_activate(TeActivation a, T x) {
  switch (a) {
    case TeActivation::kRelu: return x < T(0) ? T(0) : x;  // NaN stays NaN, as torch.relu
    case TeActivation::kGelu: return T(0.5) * x * (T(1) + erf(x * T(0.70710678118654752440)));
    case TeActivation::kSilu: return x / (T(1) + exp(-x));
    default: return tanh(x);
  }
}

/// act'(x) (relu: 1 for x > 0, else 0, as torch's relu backward at 0).
template <typename T>
ATTN_EXT_HOST_DEVICE T te_activation_derivative(TeActivation a, T x) {
  switch (a) {
    case TeActivation::kRelu: return x > T(0) ? T(1) : T(0);
    case TeActivation::kGelu: {
      const T cdf = T(0.5) * (T(1) + erf(x * T(0.70710678118654752440)));
      const T pdf = exp(T(-0.5) * x * x) * T(0.39894228040143267794);
      return cdf + x * pdf;
    }
    case TeActivation::kSilu: {
      const T s = T(1) / (T(1) + exp(-x));
      return s * (T(1) + x * (T(1) - s));
    }
    default: {
      const T t = tanh(x);
      return T(1) - t * t;
    }
  }
}

}  // namespace attn_ext
