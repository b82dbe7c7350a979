// The operator schemas of attn_ext, in one place. Each device registers its kernels for these schemas in
// one file: csrc/cpu/registration.cpp, and csrc/cuda/bindings/registration.cpp when built against a CUDA
// torch. Python adds the fake (meta) kernels and autograd formulas. Importing the extension module
// (python_module.cpp) runs these static registrations.
#include <torch/library.h>

#include "cpu/blas.h"

namespace {
std::string cpu_gemm_implementation() { return attn_ext::cpu::gemm_implementation(); }
}  // namespace

TORCH_LIBRARY(attn_ext, m) {
  m.def("cross_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, float scale, "
        "int chunk_size) -> (Tensor out, Tensor lse)");
  m.def("cross_attention_bwd(Tensor grad_out, Tensor grad_lse, Tensor q, Tensor k, Tensor v, "
        "Tensor? key_padding_mask, Tensor out, Tensor lse, float scale, int chunk_size) "
        "-> (Tensor grad_q, Tensor grad_k, Tensor grad_v)");
  // Scaled dot-product attention (SDPA's semantics): attn_mask a [B, Hq, L, S] view, bool (True = take
  // part) or additive in q's dtype; key_padding_mask [B, S] (True = padding); causal = key n <= query m;
  // Hq a multiple of Hkv (grouped heads); Philox dropout from dropout_seed (int64, one element) when
  // dropout_p > 0; lse of the undropped scores. Empty rows: out 0, lse -inf.
  m.def("attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? key_padding_mask, float scale, "
        "bool is_causal, float dropout_p, Tensor? dropout_seed, int chunk_size) -> (Tensor out, Tensor lse)");
  m.def("attention_bwd(Tensor grad_out, Tensor grad_lse, Tensor q, Tensor k, Tensor v, Tensor? attn_mask, "
        "Tensor? key_padding_mask, Tensor out, Tensor lse, float scale, bool is_causal, float dropout_p, "
        "Tensor? dropout_seed, int chunk_size) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)");
  m.def("merge_states_fwd(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) -> (Tensor out, Tensor lse)");
  m.def("merge_states_bwd(Tensor grad_out, Tensor grad_lse, Tensor out_a, Tensor lse_a, Tensor out_b, "
        "Tensor lse_b, Tensor out, Tensor lse) -> (Tensor grad_out_a, Tensor grad_lse_a, Tensor grad_out_b, "
        "Tensor grad_lse_b)");
  // Tree Cross Attention (docs/spec.md §3): fused descent + online-softmax attention over the selected nodes.
  // Greedy when uniforms is None, else inverse-CDF sampling with uniforms [B, M, height] in [0, 1).
  m.def("tree_cross_attention_fwd(Tensor q, Tensor node_k, Tensor node_v, Tensor node_padding_mask, "
        "int branching, int height, int group_size, float scale, Tensor? uniforms) "
        "-> (Tensor out, Tensor lse, Tensor selected, Tensor log_prob, Tensor entropy)");
  m.def("tree_cross_attention_bwd(Tensor grad_out, Tensor grad_lse, Tensor grad_log_prob, Tensor grad_entropy, "
        "Tensor q, Tensor node_k, Tensor node_v, Tensor node_padding_mask, Tensor selected, Tensor lse, "
        "int branching, int height, int group_size, float scale) "
        "-> (Tensor grad_q, Tensor grad_node_k, Tensor grad_node_v)");
  // Intention (docs/spec.md §4), primal form; the factor and weights are saved for the backward. Without v
  // (C = I) it returns σIntention's transformed queries scale·Q (KᵀK + αI)⁻¹.
  m.def("intention_fwd(Tensor q, Tensor k, Tensor? v, Tensor? key_padding_mask, Tensor alpha, float scale) "
        "-> (Tensor out, Tensor factor, Tensor weights)");
  m.def("intention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor? v, Tensor? key_padding_mask, Tensor factor, "
        "Tensor weights, float scale) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_alpha)");
  // σIntention forward fused (CPU): the transformed queries are made per query tile and attended at
  // once; returns what intention_fwd(v=None) and cross_attention_fwd(scale=1) would, for their backwards.
  m.def("sigma_intention_fwd(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, Tensor alpha, float scale, "
        "int chunk_size) -> (Tensor out, Tensor lse, Tensor q_tilde, Tensor factor, Tensor weights)");
  // Masked-mean aggregation of a tree's nodes from its tokens' values (docs/spec.md §3 "Aggregate") and its
  // backward; node ids as in attn_ext/tree/build.py, leaf_token -1 at padding leaf slots.
  m.def("tree_aggregate_fwd(Tensor leaf_values, Tensor leaf_token, Tensor node_padding_mask, int branching, "
        "int height, int group_size) -> Tensor");
  m.def("tree_aggregate_bwd(Tensor grad_nodes, Tensor leaf_token, Tensor token_leaf, Tensor node_padding_mask, "
        "int branching, int height, int group_size, int num_tokens) -> Tensor");
  // Batched small-SPD Cholesky (docs/spec.md §4, under the Intention op): L with A = L Lᵀ from A's lower
  // triangle and info as torch.linalg.cholesky_ex; then X = (L Lᵀ)⁻¹ B. No autograd (the Intention
  // backward differentiates through its factor by hand).
  m.def("batched_cholesky(Tensor A) -> (Tensor L, Tensor info)");
  m.def("batched_cholesky_solve(Tensor L, Tensor B) -> Tensor X");
  // Both at once, X = A⁻¹ B with the factor kept in cache (differentiable in Python).
  m.def("batched_spd_solve(Tensor A, Tensor B) -> (Tensor X, Tensor info)");
  // Diagnostics: which GEMM the CPU kernels use in this process (BLAS symbol or portable loops).
  m.def("cpu_gemm_implementation() -> str", &cpu_gemm_implementation);
}
