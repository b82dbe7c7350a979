// Parameters of the strided batched GEMM of small_gemm_kernel.cuh: plain C++ (no CUDA types), so
// that the host-side step planner of Intention (intention_plan.h) fills them without nvcc.
#pragma once

#include <cstdint>

#include "small_gemm_plan.h"

namespace attn_ext {
namespace cuda {

/// One operand: element (b, h, i, j) at data[b·stride_b + h·stride_h + i·stride_row + j·stride_col].
struct GemmOperand {
  const void* data = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_row = 0, stride_col = 0;
};

struct SmallGemmParams {
  GemmOperand a, b;      ///< rows × inner, inner × cols
  GemmOperand a2, b2;    ///< rows × inner2, inner2 × cols; a2.data == nullptr: no second term
  void* c = nullptr;     ///< rows × cols, innermost stride 1
  int64_t c_stride_b = 0, c_stride_h = 0, c_stride_row = 0;
  int64_t batch = 0, heads = 0, rows = 0, cols = 0, inner = 0, inner2 = 0;
  float alpha = 1.0f, alpha2 = 1.0f;
  /// [batch, inner] bytes, nonzero = skip that reduction index in the first term; nullptr = none.
  const uint8_t* inner_mask = nullptr;
  int64_t inner_mask_stride_b = 0;
  /// [batch, rows] bytes, nonzero = write that output row as 0; nullptr = none.
  const uint8_t* row_mask = nullptr;
  int64_t row_mask_stride_b = 0;
};

}  // namespace cuda
}  // namespace attn_ext
