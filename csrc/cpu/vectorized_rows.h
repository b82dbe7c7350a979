// Vectorised loops over one row of a score tile: the exponentials are the only transcendental work
// of attention and at D = 64 there is one per 256 flops of GEMM (at D = 16, one per 64), so a scalar
// expf would dominate. The float loops are compiled once per instruction set (vectorized_rows.cpp).
#pragma once

#include <cstdint>

#include "isa_level.h"

namespace attn_ext::cpu {

/// max over x[0..n), −inf for n = 0 or an all −inf row.
float row_max(const float* x, int64_t n);

/// x[i] ← exp(x[i] − shift) in place, returns Σ x[i]. Inputs of −inf (masked keys) give exactly 0.
/// Arguments are expected ≤ 0 + rounding (scores minus a running maximum or a log-sum-exp).
float exp_shifted_inplace_sum(float* x, int64_t n, float shift);

/// ds[i] ← p[i] · (dp[i] − delta_minus_dlse), the docs/spec.md §1 score gradient over one row (dp may alias ds).
void score_gradient_row(const float* p, const float* dp, float* ds, int64_t n, float delta_minus_dlse);

double row_max(const double* x, int64_t n);
double exp_shifted_inplace_sum(double* x, int64_t n, double shift);
void score_gradient_row(const double* p, const double* dp, double* ds, int64_t n, double delta_minus_dlse);

/// The float row loops compiled for one instruction set. The functions above use the copy for
/// isa_level() at their first call (ATTN_EXT_CPU_ISA is read then: these run once per score row, too
/// often to read the environment each time); tests call every level's copy through row_kernels().
struct RowKernels {
  float (*row_max)(const float* x, int64_t n);
  float (*exp_shifted_inplace_sum)(float* x, int64_t n, float shift);
  void (*score_gradient_row)(const float* p, const float* dp, float* ds, int64_t n, float delta_minus_dlse);
};

/// The copy for `level`; a level this CPU cannot run falls back to the best one it can.
const RowKernels& row_kernels(IsaLevel level);

}  // namespace attn_ext::cpu
