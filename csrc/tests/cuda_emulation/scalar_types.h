// The kernels' ScalarType of each emulated element type, for the emulation tests.
#pragma once

#include "cuda_emulator.h"
#include "launch_plan.h"

namespace cuda_emu {

template <typename T>
attn_ext::cuda::ScalarType scalar_type();
template <>
inline attn_ext::cuda::ScalarType scalar_type<float>() {
  return attn_ext::cuda::ScalarType::kFloat32;
}
template <>
inline attn_ext::cuda::ScalarType scalar_type<__half>() {
  return attn_ext::cuda::ScalarType::kFloat16;
}
template <>
inline attn_ext::cuda::ScalarType scalar_type<__nv_bfloat16>() {
  return attn_ext::cuda::ScalarType::kBFloat16;
}

}  // namespace cuda_emu
