// CPU implementations of attn_ext::merge_states_{fwd,bwd} (schemas in csrc/ops.cpp).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace attn_ext::cpu {

/// (out, lse) of the union of two disjoint key sets from their states; any leading dims, lse = out.shape[:-1].
std::tuple<at::Tensor, at::Tensor> merge_states_fwd_cpu(const at::Tensor& out_a, const at::Tensor& lse_a,
                                                        const at::Tensor& out_b, const at::Tensor& lse_b);

/// Gradients of both input states from those of the merged (out, lse).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> merge_states_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& out_a, const at::Tensor& lse_a,
    const at::Tensor& out_b, const at::Tensor& lse_b, const at::Tensor& out, const at::Tensor& lse);

}  // namespace attn_ext::cpu
