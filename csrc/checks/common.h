// Torch-side pieces that the CPU ops and the CUDA bindings share besides their argument checks: the
// map between torch dtypes and the kernels' ScalarType, the dtype of an op's statistics (the
// accumulation rule of attn_ext/scalar_type.h, applied to tensors) and the unit-inner-stride view
// every kernel reads its rows through.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <optional>
#include <type_traits>

#include "attn_ext/scalar_type.h"

namespace attn_ext {

// The CPU kernels accumulate in acc_type<scalar_t>, ATen's own kernels in opmath_type: they agree, so
// an op's statistics match what torch computes from the same inputs.
static_assert(std::is_same_v<acc_type<c10::Half>, at::opmath_type<c10::Half>> &&
                  std::is_same_v<acc_type<c10::BFloat16>, at::opmath_type<c10::BFloat16>> &&
                  std::is_same_v<acc_type<float>, at::opmath_type<float>> &&
                  std::is_same_v<acc_type<double>, at::opmath_type<double>>,
              "attn_ext's accumulation rule is ATen's");

/// The kernels' element type of a torch dtype; nullopt for a dtype no kernel takes.
inline std::optional<ScalarType> scalar_type_of(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return ScalarType::kFloat32;
    case at::kHalf: return ScalarType::kFloat16;
    case at::kBFloat16: return ScalarType::kBFloat16;
    case at::kDouble: return ScalarType::kFloat64;
    default: return std::nullopt;
  }
}

inline at::ScalarType torch_dtype(ScalarType t) {
  switch (t) {
    case ScalarType::kFloat16: return at::kHalf;
    case ScalarType::kBFloat16: return at::kBFloat16;
    case ScalarType::kFloat64: return at::kDouble;
    default: return at::kFloat;
  }
}

/// The dtype of the statistics an op returns for inputs of `input` (lse, log-probabilities, the
/// Intention factor and weights): fp32, fp64 for fp64 inputs. A dtype no kernel takes maps as fp32:
/// some checks name the expected lse dtype before the op's own dtype check refuses the input.
inline at::ScalarType accumulation_dtype(at::ScalarType input) {
  return torch_dtype(accumulation_type(scalar_type_of(input).value_or(ScalarType::kFloat32)));
}

/// The kernels take any outer strides but read each row with unit stride (a row of one element has
/// no stride to speak of, so it is not copied).
inline at::Tensor with_unit_inner_stride(const at::Tensor& t) {
  return t.dim() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

}  // namespace attn_ext
