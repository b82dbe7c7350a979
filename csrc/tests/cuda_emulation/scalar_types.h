// The kernels' ScalarType of each emulated element type, for the emulation tests.
#pragma once

#include "attn_ext/scalar_type.h"
#include "cuda_emulator.h"

namespace cuda_emu {

template <typename T>
attn_ext::ScalarType scalar_type();
template <>
inline attn_ext::ScalarType scalar_type<float>() {
  return attn_ext::ScalarType::kFloat32;
}
template <>
inline attn_ext::ScalarType scalar_type<__half>() {
  return attn_ext::ScalarType::kFloat16;
}
template <>
inline attn_ext::ScalarType scalar_type<__nv_bfloat16>() {
  return attn_ext::ScalarType::kBFloat16;
}

}  // namespace cuda_emu
