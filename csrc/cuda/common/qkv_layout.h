// The part of every attention kernel's arguments that describes its q, k and v: element strides of
// q [B,H,M,D], k [B,H,N,D] (or the tree's node_k) and v [B,H,N,Dv] (any outer strides, including 0
// for broadcast, innermost stride 1), the key padding mask's batch stride, the score scale and the
// element type. The params structs derive from it, so kernels read p.q_stride_b etc. as before and
// the torch bindings fill it in one place (bindings/tensor_checks.h).
//
// Plain C++ (no CUDA headers), like the plans.
#pragma once

#include <cstdint>

#include "attn_ext/scalar_type.h"

namespace attn_ext {
namespace cuda {

struct QkvLayout {
  int64_t q_stride_b = 0, q_stride_h = 0, q_stride_m = 0;
  int64_t k_stride_b = 0, k_stride_h = 0, k_stride_n = 0;
  int64_t v_stride_b = 0, v_stride_h = 0, v_stride_n = 0;  ///< 0 when there is no v (Intention's C = I)
  int64_t mask_stride_b = 0;                                ///< elements between mask rows (batches)
  float scale = 1.0f;  ///< multiplies q·k; the caller resolves the 1/sqrt(D) default
  ScalarType dtype = ScalarType::kFloat32;  ///< of q, k, v and the outputs of their shape
};

}  // namespace cuda
}  // namespace attn_ext
