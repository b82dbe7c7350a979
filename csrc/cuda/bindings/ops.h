// The CUDA kernels of the attn_ext ops, as the typed functions csrc/cuda/bindings/registration.cpp
// registers for the schemas of csrc/schemas.cpp: each unpacks its tensors into the torch-free
// launcher's params (csrc/cuda/*.cuh) after the argument checks it shares with the CPU op
// (csrc/checks/). Same results, shapes and dtypes as the CPU ops of csrc/cpu/ops.h, for float32,
// float16 and bfloat16 inputs. Compiled only against a CUDA build of torch.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace attn_ext::cuda {

// ---- chunked cross attention (cross_attention.cpp)

std::tuple<at::Tensor, at::Tensor> cross_attention_fwd_cuda(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v,
                                                            const std::optional<at::Tensor>& key_padding_mask,
                                                            double scale, int64_t chunk_size);

std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_attention_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const std::optional<at::Tensor>& key_padding_mask, const at::Tensor& out,
    const at::Tensor& lse, double scale, int64_t chunk_size);

std::tuple<at::Tensor, at::Tensor> merge_states_fwd_cuda(const at::Tensor& out_a, const at::Tensor& lse_a,
                                                         const at::Tensor& out_b, const at::Tensor& lse_b);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> merge_states_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& out_a, const at::Tensor& lse_a,
    const at::Tensor& out_b, const at::Tensor& lse_b, const at::Tensor& out, const at::Tensor& lse);

// ---- attention with causal / attn_mask / grouped-query heads (attention.cpp); dropout_p > 0 raises
// NotImplementedError (no dropout in the CUDA kernels).

std::tuple<at::Tensor, at::Tensor> attention_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      const std::optional<at::Tensor>& attn_mask,
                                                      const std::optional<at::Tensor>& key_padding_mask, double scale,
                                                      bool is_causal, double dropout_p,
                                                      const std::optional<at::Tensor>& dropout_seed,
                                                      int64_t chunk_size);

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
    const at::Tensor& out, const at::Tensor& lse, double scale, bool is_causal, double dropout_p,
    const std::optional<at::Tensor>& dropout_seed, int64_t chunk_size);

// ---- tree (tree.cpp)

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> tree_cross_attention_fwd_cuda(
    const at::Tensor& q, const at::Tensor& node_k, const at::Tensor& node_v, const at::Tensor& node_padding_mask,
    int64_t branching, int64_t height, int64_t group_size, double scale, const std::optional<at::Tensor>& uniforms);

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_cross_attention_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& grad_log_prob,
    const at::Tensor& grad_entropy, const at::Tensor& q, const at::Tensor& node_k, const at::Tensor& node_v,
    const at::Tensor& node_padding_mask, const at::Tensor& selected, const at::Tensor& lse, int64_t branching,
    int64_t height, int64_t group_size, double scale);

at::Tensor tree_aggregate_fwd_cuda(const at::Tensor& leaf_values, const at::Tensor& leaf_token,
                                   const at::Tensor& node_padding_mask, int64_t branching, int64_t height,
                                   int64_t group_size);

at::Tensor tree_aggregate_bwd_cuda(const at::Tensor& grad_nodes, const at::Tensor& leaf_token,
                                   const at::Tensor& token_leaf, const at::Tensor& node_padding_mask,
                                   int64_t branching, int64_t height, int64_t group_size, int64_t num_tokens);

// ---- Intention (intention.cpp)

std::tuple<at::Tensor, at::Tensor, at::Tensor> intention_fwd_cuda(const at::Tensor& q, const at::Tensor& k,
                                                                  const std::optional<at::Tensor>& v,
                                                                  const std::optional<at::Tensor>& key_padding_mask,
                                                                  const at::Tensor& alpha, double scale);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> intention_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& key_padding_mask, const at::Tensor& factor, const at::Tensor& weights,
    double scale);

std::tuple<at::Tensor, at::Tensor> batched_cholesky_cuda(const at::Tensor& a);

at::Tensor batched_cholesky_solve_cuda(const at::Tensor& l, const at::Tensor& b);

}  // namespace attn_ext::cuda
