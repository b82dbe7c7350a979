// CPU implementations of attn_ext::batched_cholesky and attn_ext::batched_cholesky_solve (schemas in
// csrc/ops.cpp): the batched small-SPD factorisation and solves under the Intention op (SPEC §4).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace attn_ext::cpu {

/// (L [..., n, n], info int32 [...]) with A = L Lᵀ per matrix, reading only A's lower triangle;
/// info as torch.linalg.cholesky_ex (0, or j + 1 for a non-positive or non-finite pivot at column j).
/// float32 and float64 only.
std::tuple<at::Tensor, at::Tensor> batched_cholesky_cpu(const at::Tensor& a);

/// X [..., n, r] = (L Lᵀ)⁻¹ B per matrix, for lower factors L [..., n, n] (lower triangle read) and
/// B [..., n, r] with the same batch dimensions (no broadcasting) and dtype.
at::Tensor batched_cholesky_solve_cpu(const at::Tensor& l, const at::Tensor& b);

/// (X [..., n, r], info int32 [...]) with X = A⁻¹ B per SPD matrix A [..., n, n] (lower triangle
/// read), factor and solves fused; X is NaN where info is nonzero. Same batch dims and dtype, no
/// broadcasting; float32 and float64 only.
std::tuple<at::Tensor, at::Tensor> batched_spd_solve_cpu(const at::Tensor& a, const at::Tensor& b);

}  // namespace attn_ext::cpu
