// The CPU kernels of every attn_ext op, as the typed functions csrc/cpu/registration.cpp registers
// for the schemas of csrc/schemas.cpp (the CUDA ones are in csrc/cuda/bindings/ops.h). Each checks
// its arguments with the shared checks of csrc/checks/, so both devices fail with the same messages.
// Statistics (lse, log-probabilities, the Intention factor) are in the accumulation dtype of
// attn_ext/scalar_type.h: fp32, fp64 for fp64 inputs.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace attn_ext::cpu {

// ---- attention (attention_ops.cpp, attention_fwd.cpp, attention_bwd.cpp, merge_states.cpp)

/// Scaled dot-product attention with an optional attn_mask [B, Hq, L, S] view (bool, True = take part,
/// or additive in q's dtype), key padding [B, S] (True = padding), causal (key n ≤ query m), grouped
/// heads (query head h reads kv head h / (Hq / Hkv)) and Philox dropout: (out [B, Hq, L, Dv], lse [B, Hq, L]).
std::tuple<at::Tensor, at::Tensor> attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const std::optional<at::Tensor>& attn_mask,
                                                     const std::optional<at::Tensor>& key_padding_mask, double scale,
                                                     bool is_causal, double dropout_p,
                                                     const std::optional<at::Tensor>& dropout_seed, int64_t chunk_size);

/// Its backward: (grad_q, grad_k, grad_v), the dropout regenerated from the seed.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
    const at::Tensor& out, const at::Tensor& lse, double scale, bool is_causal, double dropout_p,
    const std::optional<at::Tensor>& dropout_seed, int64_t chunk_size);


/// Forward: (out [B,H,M,Dv] in q's dtype, lse [B,H,M]).
std::tuple<at::Tensor, at::Tensor> cross_attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v,
                                                          const std::optional<at::Tensor>& key_padding_mask,
                                                          double scale, int64_t chunk_size);

/// Backward: (grad_q, grad_k, grad_v) from the gradients of out and lse and the saved out/lse.
std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_attention_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const std::optional<at::Tensor>& key_padding_mask, const at::Tensor& out,
    const at::Tensor& lse, double scale, int64_t chunk_size);

/// (out, lse) of the union of two disjoint key sets from their states; any leading dims, lse = out.shape[:-1].
std::tuple<at::Tensor, at::Tensor> merge_states_fwd_cpu(const at::Tensor& out_a, const at::Tensor& lse_a,
                                                        const at::Tensor& out_b, const at::Tensor& lse_b);

/// Gradients of both input states from those of the merged (out, lse).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> merge_states_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& out_a, const at::Tensor& lse_a,
    const at::Tensor& out_b, const at::Tensor& lse_b, const at::Tensor& out, const at::Tensor& lse);

// ---- tree (tree_cross_attention.cpp, tree_cross_attention_bwd.cpp, tree_aggregate.cpp)

/// Fused Tree Cross Attention forward (docs/spec.md §3): per query, descend the tree (greedy, or sampled with
/// `uniforms` [B, M, height]) and attend over the selected set with an online softmax.
/// Returns (out [B,H,M,Dv] in q's dtype, lse [B,H,M], selected [B,M,S] int64, log_prob [B,M],
/// entropy [B,M]).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> tree_cross_attention_fwd_cpu(
    const at::Tensor& q, const at::Tensor& node_k, const at::Tensor& node_v, const at::Tensor& node_padding_mask,
    int64_t branching, int64_t height, int64_t group_size, double scale, const std::optional<at::Tensor>& uniforms);

/// Its backward: (grad_q, grad_node_k, grad_node_v) from the gradients of (out, lse, log_prob,
/// entropy), given the forward's `selected` and `lse`. Deterministic (no atomics).
std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_cross_attention_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& grad_log_prob,
    const at::Tensor& grad_entropy, const at::Tensor& q, const at::Tensor& node_k, const at::Tensor& node_v,
    const at::Tensor& node_padding_mask, const at::Tensor& selected, const at::Tensor& lse, int64_t branching,
    int64_t height, int64_t group_size, double scale);

/// Node values [B, num_nodes, E] of a Tree Cross Attention tree (docs/spec.md §3 "Aggregate", masked mean) from
/// the tokens' values leaf_values [B, N, E]: leaf slot s holds token leaf_token[:, s] (0 for padding
/// leaves), every other node the mean of its valid children (0 for padding nodes). Node ids as in
/// attn_ext/tree/build.py; output in the input dtype, sums and means in the accumulation dtype.
at::Tensor tree_aggregate_fwd_cpu(const at::Tensor& leaf_values, const at::Tensor& leaf_token,
                                  const at::Tensor& node_padding_mask, int64_t branching, int64_t height,
                                  int64_t group_size);

/// Gradient of the tokens' values [B, num_tokens, E] from that of the node values [B, num_nodes, E];
/// token_leaf [B, num_tokens] is the inverse permutation of leaf_token (checked). Masked tokens get 0.
at::Tensor tree_aggregate_bwd_cpu(const at::Tensor& grad_nodes, const at::Tensor& leaf_token,
                                  const at::Tensor& token_leaf, const at::Tensor& node_padding_mask,
                                  int64_t branching, int64_t height, int64_t group_size, int64_t num_tokens);

// ---- Intention (intention.cpp, sigma_intention.cpp, batched_cholesky.cpp)

/// Intention, primal form (docs/spec.md §4): out = scale·Q (KᵀK + αI)⁻¹ KᵀV with alpha [B, H].
/// Returns (out [B,H,M,Dv] in q's dtype, factor L [B,H,D,D] with LLᵀ = KᵀK + αI (lower triangle
/// meaningful), weights W = (KᵀK + αI)⁻¹KᵀV [B,H,D,Dv]).
/// Without v, C = I: out = scale·Q (KᵀK + αI)⁻¹, the transformed queries of σIntention.
/// A factorisation that fails (α = 0 with a singular Gram matrix) raises ValueError.
std::tuple<at::Tensor, at::Tensor, at::Tensor> intention_fwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                                                 const std::optional<at::Tensor>& v,
                                                                 const std::optional<at::Tensor>& key_padding_mask,
                                                                 const at::Tensor& alpha, double scale);

/// Its backward from the saved L and W: (grad_q, grad_k, grad_v, grad_alpha [B, H]).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> intention_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& key_padding_mask, const at::Tensor& factor, const at::Tensor& weights,
    double scale);

/// σIntention fused: out = softmax(scale·Q (KᵀK + αI)⁻¹ Kᵀ) V over the valid keys. Returns (out
/// [B,H,M,Dv], lse [B,H,M], q_tilde = scale·Q (KᵀK + αI)⁻¹ [B,H,M,D] in q's dtype, factor L
/// [B,H,D,D], weights (KᵀK + αI)⁻¹ [B,H,D,D]): exactly what intention_fwd(v=None) followed by
/// cross_attention_fwd(q_tilde, k, v, scale=1) return, for their backwards. CPU only.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> sigma_intention_fwd_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& key_padding_mask,
    const at::Tensor& alpha, double scale, int64_t chunk_size);

/// (L [..., n, n], info int32 [...]) with A = L Lᵀ per matrix, reading only A's lower triangle;
/// info as torch.linalg.cholesky_ex (0, or j + 1 for a non-positive or non-finite pivot at column j).
/// float32 and float64 only.
std::tuple<at::Tensor, at::Tensor> batched_cholesky_cpu(const at::Tensor& a);

/// X [..., n, r] = (L Lᵀ)⁻¹ B per matrix, for lower factors L [..., n, n] (lower triangle read) and
/// B [..., n, r] with the same batch dimensions (no broadcasting) and dtype.
at::Tensor batched_cholesky_solve_cpu(const at::Tensor& l, const at::Tensor& b);

/// (X [..., n, r], info int32 [...]) with X = A⁻¹ B per SPD matrix A [..., n, n] (lower triangle
/// read), factor and solves fused; X is NaN where info is nonzero. Same batch dims and dtype, no
/// broadcasting; float32 and float64 only. CPU only.
std::tuple<at::Tensor, at::Tensor> batched_spd_solve_cpu(const at::Tensor& a, const at::Tensor& b);

}  // namespace attn_ext::cpu
