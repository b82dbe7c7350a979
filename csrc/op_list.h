// Every attn_ext op, once: its name, the C++ signature of its typed kernels (return type and parameter
// list) and its schema. Each entry is
//
//   ATTN_EXT_OP(name, (return type), (parameter list), "schema")
//
// with the types in parentheses (they hold commas; ATTN_EXT_UNPAREN removes them). Included with
// ATTN_EXT_OP defined, this header expands it once per op and undefines it; included without, it only
// brings the types the entries use, so that a file includes it at its top and expands it wherever it
// needs to (inside a namespace or a function body, where no #include of a library header may happen):
//   csrc/schemas.cpp                    m.def(schema) for every op
//   csrc/cpu/ops.h                      the declarations of attn_ext::cpu::<name>_cpu
//   csrc/cpu/registration.cpp           m.impl(name, <name>_cpu) for every op
//   csrc/cuda/bindings/ops.h            the declarations of attn_ext::cuda::<name>_cuda (an op without a
//                                       CUDA kernel, sigma_intention_fwd and batched_spd_solve, is declared
//                                       and never defined)
// The dispatcher checks at load time that each registered typed kernel matches its schema; schemas.cpp
// checks at compile time that each schema string names its op. build_support/schemas.py reads the
// schema strings of this file (as written: adjacent literals, no macros) for the Python side.
//
// Statistics (lse, log-probabilities, the Intention factor) are in the accumulation dtype of
// attn_ext/scalar_type.h: fp32, fp64 for fp64 inputs.
//
// No include guard: the entries are meant to be expanded once per definition of ATTN_EXT_OP.
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>

#ifndef ATTN_EXT_UNPAREN
/// ATTN_EXT_UNPAREN (a, b) is a, b: unwraps an entry's parenthesised return type or parameter list.
#define ATTN_EXT_UNPAREN(...) __VA_ARGS__
#endif

#ifdef ATTN_EXT_OP

// ---- attention (CPU: attention_ops.cpp, attention_fwd.cpp, attention_bwd.cpp, merge_states.cpp;
// CUDA: bindings/attention.cpp, bindings/merge_states.cpp)

/// Scaled dot-product attention (SDPA's semantics) with an optional attn_mask [B, Hq, L, S] view (bool,
/// True = take part, or additive in q's dtype), key padding [B, S] (True = padding), a band about each
/// query's diagonal key m + diagonal (causal: keys n ≤ m + diagonal; window_left / window_right ≥ 0: keys
/// m + diagonal − window_left ≤ n ≤ m + diagonal + window_right, −1 unbounded), grouped heads (Hq a
/// multiple of Hkv: query head h reads kv head h / (Hq / Hkv)), Philox dropout from dropout_seed
/// (int64, one element) when dropout_p > 0, a soft cap (softcap > 0: scores c·tanh(s / c) before the mask)
/// and ALiBi (alibi_slopes fp32 [B, Hq]: scores − slope·|m + diagonal − n|): (out [B, Hq, L, Dv],
/// lse [B, Hq, L]), lse of the undropped scores. Empty rows: out 0, lse -inf. With cu_seqlens_q/k (int32
/// [S + 1]) a packed batch of S sequences: B = 1, sequence s's query rows cu_q[s] .. cu_q[s + 1] attend its key
/// rows cu_k[s] .. cu_k[s + 1] only, the band aligned per sequence (bottom_right: at the end of its keys;
/// diagonal must be 0), alibi_slopes [S, Hq]; no attn_mask or key padding.
ATTN_EXT_OP(attention_fwd, (std::tuple<at::Tensor, at::Tensor>),
            (const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& attn_mask,
             const std::optional<at::Tensor>& key_padding_mask, double scale, bool is_causal, double dropout_p,
             const std::optional<at::Tensor>& dropout_seed, int64_t chunk_size, int64_t window_left,
             int64_t window_right, int64_t diagonal, double softcap, const std::optional<at::Tensor>& alibi_slopes,
             const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
             bool bottom_right),
            "attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? key_padding_mask, float scale, "
            "bool is_causal, float dropout_p, Tensor? dropout_seed, int chunk_size, int window_left=-1, "
            "int window_right=-1, int diagonal=0, float softcap=0.0, Tensor? alibi_slopes=None, "
            "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, bool bottom_right=False) -> "
            "(Tensor out, Tensor lse)")

/// Its backward: (grad_q, grad_k, grad_v), the dropout regenerated from the seed.
ATTN_EXT_OP(attention_bwd, (std::tuple<at::Tensor, at::Tensor, at::Tensor>),
            (const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& q, const at::Tensor& k,
             const at::Tensor& v, const std::optional<at::Tensor>& attn_mask,
             const std::optional<at::Tensor>& key_padding_mask, const at::Tensor& out, const at::Tensor& lse,
             double scale, bool is_causal, double dropout_p, const std::optional<at::Tensor>& dropout_seed,
             int64_t chunk_size, int64_t window_left, int64_t window_right, int64_t diagonal, double softcap,
             const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& cu_seqlens_q,
             const std::optional<at::Tensor>& cu_seqlens_k, bool bottom_right),
            "attention_bwd(Tensor grad_out, Tensor grad_lse, Tensor q, Tensor k, Tensor v, Tensor? attn_mask, "
            "Tensor? key_padding_mask, Tensor out, Tensor lse, float scale, bool is_causal, float dropout_p, "
            "Tensor? dropout_seed, int chunk_size, int window_left=-1, int window_right=-1, int diagonal=0, "
            "float softcap=0.0, Tensor? alibi_slopes=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
            "bool bottom_right=False) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)")

/// attention_bwd of a call whose additive attn_mask (a learned bias) is differentiated too: (grad_q, grad_k, grad_v,
/// grad_mask), grad_mask the gradient of the attn_mask [B, Hq, L, S] view with its broadcast dims (stride 0) of
/// size 1, in the accumulation dtype, summed tile by tile (no [L, S] buffer); no packed batch.
ATTN_EXT_OP(attention_bwd_bias, (std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>),
            (const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& q, const at::Tensor& k,
             const at::Tensor& v, const at::Tensor& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
             const at::Tensor& out, const at::Tensor& lse, double scale, bool is_causal, double dropout_p,
             const std::optional<at::Tensor>& dropout_seed, int64_t chunk_size, int64_t window_left,
             int64_t window_right, int64_t diagonal, double softcap, const std::optional<at::Tensor>& alibi_slopes),
            "attention_bwd_bias(Tensor grad_out, Tensor grad_lse, Tensor q, Tensor k, Tensor v, Tensor attn_mask, "
            "Tensor? key_padding_mask, Tensor out, Tensor lse, float scale, bool is_causal, float dropout_p, "
            "Tensor? dropout_seed, int chunk_size, int window_left=-1, int window_right=-1, int diagonal=0, "
            "float softcap=0.0, Tensor? alibi_slopes=None) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, "
            "Tensor grad_mask)")

/// Cross attention, attention_fwd's case without attn_mask, causal, grouped heads or dropout.
/// Forward: (out [B,H,M,Dv] in q's dtype, lse [B,H,M]).
ATTN_EXT_OP(cross_attention_fwd, (std::tuple<at::Tensor, at::Tensor>),
            (const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
             const std::optional<at::Tensor>& key_padding_mask, double scale, int64_t chunk_size),
            "cross_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, float scale, "
            "int chunk_size) -> (Tensor out, Tensor lse)")

/// Backward: (grad_q, grad_k, grad_v) from the gradients of out and lse and the saved out/lse.
ATTN_EXT_OP(cross_attention_bwd, (std::tuple<at::Tensor, at::Tensor, at::Tensor>),
            (const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& q, const at::Tensor& k,
             const at::Tensor& v, const std::optional<at::Tensor>& key_padding_mask, const at::Tensor& out,
             const at::Tensor& lse, double scale, int64_t chunk_size),
            "cross_attention_bwd(Tensor grad_out, Tensor grad_lse, Tensor q, Tensor k, Tensor v, "
            "Tensor? key_padding_mask, Tensor out, Tensor lse, float scale, int chunk_size) "
            "-> (Tensor grad_q, Tensor grad_k, Tensor grad_v)")

/// New tokens over a paged key/value cache: q [B, Hq, M, D] (the last M positions of each entry's keys), k_cache
/// [num_blocks, block_size, Hkv, D], v_cache [..., Dv], block_table int32 [B, max_blocks] (entry b's key n is row
/// n % block_size of block block_table[b, n / block_size]), cache_seqlens int32 [B]; the causal rule, window,
/// soft cap and ALiBi ([B, Hq]) aligned bottom-right per entry: (out [B, Hq, M, Dv], lse [B, Hq, M]). Forward
/// only (ae.paged_attention differentiates through a gather instead).
ATTN_EXT_OP(paged_attention_fwd, (std::tuple<at::Tensor, at::Tensor>),
            (const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
             const at::Tensor& cache_seqlens, double scale, bool is_causal, int64_t window_left, int64_t window_right,
             double softcap, const std::optional<at::Tensor>& alibi_slopes, int64_t chunk_size),
            "paged_attention_fwd(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor cache_seqlens, "
            "float scale, bool is_causal, int window_left, int window_right, float softcap, Tensor? alibi_slopes, "
            "int chunk_size) -> (Tensor out, Tensor lse)")

/// (out, lse) of the union of two disjoint key sets from their states; any leading dims, lse = out.shape[:-1].
ATTN_EXT_OP(merge_states_fwd, (std::tuple<at::Tensor, at::Tensor>),
            (const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& out_b, const at::Tensor& lse_b),
            "merge_states_fwd(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) -> (Tensor out, Tensor lse)")

/// Gradients of both input states from those of the merged (out, lse).
ATTN_EXT_OP(merge_states_bwd, (std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>),
            (const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& out_a,
             const at::Tensor& lse_a, const at::Tensor& out_b, const at::Tensor& lse_b, const at::Tensor& out,
             const at::Tensor& lse),
            "merge_states_bwd(Tensor grad_out, Tensor grad_lse, Tensor out_a, Tensor lse_a, Tensor out_b, "
            "Tensor lse_b, Tensor out, Tensor lse) -> (Tensor grad_out_a, Tensor grad_lse_a, Tensor grad_out_b, "
            "Tensor grad_lse_b)")

// ---- translation-equivariant attention (CPU: te_attention.cpp, te_attention_bwd.cpp; no CUDA kernel)

/// TE-TNP attention (Ashman et al. 2024): logits ρ(scale·q_i·k_j of every head, xq_i − xk_j) with ρ = Linear(H + dx →
/// hidden) (w1 [hidden, H + dx], b1 [hidden]), an activation (0 relu, 1 gelu (erf), 2 silu, 3 tanh), Linear(hidden →
/// H) (w2 [H, hidden], b2 [H]); softmax over the keys per head, values summed. q [B, H, M, D], k [B, H, N, D], v [B,
/// H, N, Dv], xq [B, M, dx], xk [B, N, dx], key_padding_mask [B, N] (True = padding; a padded key's rows are never
/// read). Computed per tile of (query, key) pairs, chunk_size keys at a time (0: the kernel's choice): memory
/// independent of M·N. (out [B, H, M, Dv] in q's dtype, lse [B, H, M]); rows without a key: out 0, lse -inf.
ATTN_EXT_OP(te_attention_fwd, (std::tuple<at::Tensor, at::Tensor>),
            (const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& xq, const at::Tensor& xk,
             const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2, const at::Tensor& b2,
             const std::optional<at::Tensor>& key_padding_mask, double scale, int64_t activation, int64_t chunk_size),
            "te_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor xq, Tensor xk, Tensor w1, Tensor b1, Tensor w2, "
            "Tensor b2, Tensor? key_padding_mask, float scale, int activation, int chunk_size) -> "
            "(Tensor out, Tensor lse)")

/// Its backward from the saved (out, lse), each tile's MLP recomputed: the gradients of the nine tensors (q, k, v,
/// xq, xk, w1, b1, w2, b2), each in its input's dtype.
ATTN_EXT_OP(te_attention_bwd,
            (std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                        at::Tensor>),
            (const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& q, const at::Tensor& k,
             const at::Tensor& v, const at::Tensor& xq, const at::Tensor& xk, const at::Tensor& w1,
             const at::Tensor& b1, const at::Tensor& w2, const at::Tensor& b2,
             const std::optional<at::Tensor>& key_padding_mask, const at::Tensor& out, const at::Tensor& lse,
             double scale, int64_t activation, int64_t chunk_size),
            "te_attention_bwd(Tensor grad_out, Tensor grad_lse, Tensor q, Tensor k, Tensor v, Tensor xq, Tensor xk, "
            "Tensor w1, Tensor b1, Tensor w2, Tensor b2, Tensor? key_padding_mask, Tensor out, Tensor lse, "
            "float scale, int activation, int chunk_size) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, "
            "Tensor grad_xq, Tensor grad_xk, Tensor grad_w1, Tensor grad_b1, Tensor grad_w2, Tensor grad_b2)")

// ---- tree (CPU: tree_cross_attention.cpp, tree_cross_attention_bwd.cpp, tree_aggregate.cpp; CUDA: bindings/tree.cpp)

// Tree Cross Attention (docs/spec.md §3): fused descent + online-softmax attention over the selected nodes.
// Greedy when uniforms is None, else inverse-CDF sampling with uniforms [B, M, height] in [0, 1).

/// Fused Tree Cross Attention forward (docs/spec.md §3): per query, descend the tree (greedy, or sampled with
/// `uniforms` [B, M, height]) and attend over the selected set with an online softmax.
/// Returns (out [B,H,M,Dv] in q's dtype, lse [B,H,M], selected [B,M,S] int64, log_prob [B,M],
/// entropy [B,M]).
ATTN_EXT_OP(tree_cross_attention_fwd, (std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>),
            (const at::Tensor& q, const at::Tensor& node_k, const at::Tensor& node_v,
             const at::Tensor& node_padding_mask, int64_t branching, int64_t height, int64_t group_size,
             double scale, const std::optional<at::Tensor>& uniforms),
            "tree_cross_attention_fwd(Tensor q, Tensor node_k, Tensor node_v, Tensor node_padding_mask, "
            "int branching, int height, int group_size, float scale, Tensor? uniforms) "
            "-> (Tensor out, Tensor lse, Tensor selected, Tensor log_prob, Tensor entropy)")

/// Its backward: (grad_q, grad_node_k, grad_node_v) from the gradients of (out, lse, log_prob,
/// entropy), given the forward's `selected` and `lse`. Deterministic (no atomics).
ATTN_EXT_OP(tree_cross_attention_bwd, (std::tuple<at::Tensor, at::Tensor, at::Tensor>),
            (const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& grad_log_prob,
             const at::Tensor& grad_entropy, const at::Tensor& q, const at::Tensor& node_k,
             const at::Tensor& node_v, const at::Tensor& node_padding_mask, const at::Tensor& selected,
             const at::Tensor& lse, int64_t branching, int64_t height, int64_t group_size, double scale),
            "tree_cross_attention_bwd(Tensor grad_out, Tensor grad_lse, Tensor grad_log_prob, Tensor grad_entropy, "
            "Tensor q, Tensor node_k, Tensor node_v, Tensor node_padding_mask, Tensor selected, Tensor lse, "
            "int branching, int height, int group_size, float scale) "
            "-> (Tensor grad_q, Tensor grad_node_k, Tensor grad_node_v)")

// Masked-mean aggregation of a tree's nodes from its tokens' values (docs/spec.md §3 "Aggregate") and its
// backward; node ids as in attn_ext/tree/build.py, leaf_token -1 at padding leaf slots.

/// Node values [B, num_nodes, E] of a Tree Cross Attention tree (docs/spec.md §3 "Aggregate", masked mean) from
/// the tokens' values leaf_values [B, N, E]: leaf slot s holds token leaf_token[:, s] (0 for padding
/// leaves), every other node the mean of its valid children (0 for padding nodes). Node ids as in
/// attn_ext/tree/build.py; output in the input dtype, sums and means in the accumulation dtype.
ATTN_EXT_OP(tree_aggregate_fwd, (at::Tensor),
            (const at::Tensor& leaf_values, const at::Tensor& leaf_token, const at::Tensor& node_padding_mask,
             int64_t branching, int64_t height, int64_t group_size),
            "tree_aggregate_fwd(Tensor leaf_values, Tensor leaf_token, Tensor node_padding_mask, int branching, "
            "int height, int group_size) -> Tensor")

/// Gradient of the tokens' values [B, num_tokens, E] from that of the node values [B, num_nodes, E];
/// token_leaf [B, num_tokens] is the inverse permutation of leaf_token (checked). Masked tokens get 0.
ATTN_EXT_OP(tree_aggregate_bwd, (at::Tensor),
            (const at::Tensor& grad_nodes, const at::Tensor& leaf_token, const at::Tensor& token_leaf,
             const at::Tensor& node_padding_mask, int64_t branching, int64_t height, int64_t group_size,
             int64_t num_tokens),
            "tree_aggregate_bwd(Tensor grad_nodes, Tensor leaf_token, Tensor token_leaf, Tensor node_padding_mask, "
            "int branching, int height, int group_size, int num_tokens) -> Tensor")

// ---- Intention (CPU: intention.cpp, sigma_intention.cpp, batched_cholesky.cpp; CUDA: bindings/intention.cpp)

/// Intention, primal form (docs/spec.md §4): out = scale·Q (KᵀK + αI)⁻¹ KᵀV with alpha [B, H].
/// Returns (out [B,H,M,Dv] in q's dtype, factor L [B,H,D,D] with LLᵀ = KᵀK + αI (lower triangle
/// meaningful), weights W = (KᵀK + αI)⁻¹KᵀV [B,H,D,Dv]); the factor and weights are saved for the backward.
/// Without v, C = I: out = scale·Q (KᵀK + αI)⁻¹, the transformed queries of σIntention.
/// A factorisation that fails (α = 0 with a singular Gram matrix) raises ValueError.
ATTN_EXT_OP(intention_fwd, (std::tuple<at::Tensor, at::Tensor, at::Tensor>),
            (const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& v,
             const std::optional<at::Tensor>& key_padding_mask, const at::Tensor& alpha, double scale),
            "intention_fwd(Tensor q, Tensor k, Tensor? v, Tensor? key_padding_mask, Tensor alpha, float scale) "
            "-> (Tensor out, Tensor factor, Tensor weights)")

/// Its backward from the saved L and W: (grad_q, grad_k, grad_v, grad_alpha [B, H]).
ATTN_EXT_OP(intention_bwd, (std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>),
            (const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
             const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& key_padding_mask,
             const at::Tensor& factor, const at::Tensor& weights, double scale),
            "intention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor? v, Tensor? key_padding_mask, Tensor factor, "
            "Tensor weights, float scale) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_alpha)")

/// σIntention forward fused (CPU only): out = softmax(scale·Q (KᵀK + αI)⁻¹ Kᵀ) V over the valid keys, the
/// transformed queries made per query tile and attended at once. Returns (out [B,H,M,Dv], lse [B,H,M],
/// q_tilde = scale·Q (KᵀK + αI)⁻¹ [B,H,M,D] in q's dtype, factor L [B,H,D,D], weights (KᵀK + αI)⁻¹
/// [B,H,D,D]): exactly what intention_fwd(v=None) followed by cross_attention_fwd(q_tilde, k, v, scale=1)
/// return, for their backwards.
ATTN_EXT_OP(sigma_intention_fwd, (std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>),
            (const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
             const std::optional<at::Tensor>& key_padding_mask, const at::Tensor& alpha, double scale,
             int64_t chunk_size),
            "sigma_intention_fwd(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, Tensor alpha, float scale, "
            "int chunk_size) -> (Tensor out, Tensor lse, Tensor q_tilde, Tensor factor, Tensor weights)")

// Batched small-SPD Cholesky (docs/spec.md §4, under the Intention op): L with A = L Lᵀ from A's lower
// triangle and info as torch.linalg.cholesky_ex; then X = (L Lᵀ)⁻¹ B. No autograd (the Intention
// backward differentiates through its factor by hand).

/// (L [..., n, n], info int32 [...]) with A = L Lᵀ per matrix, reading only A's lower triangle;
/// info as torch.linalg.cholesky_ex (0, or j + 1 for a non-positive or non-finite pivot at column j).
/// float32 and float64 only.
ATTN_EXT_OP(batched_cholesky, (std::tuple<at::Tensor, at::Tensor>), (const at::Tensor& a),
            "batched_cholesky(Tensor A) -> (Tensor L, Tensor info)")

/// X [..., n, r] = (L Lᵀ)⁻¹ B per matrix, for lower factors L [..., n, n] (lower triangle read) and
/// B [..., n, r] with the same batch dimensions (no broadcasting) and dtype.
ATTN_EXT_OP(batched_cholesky_solve, (at::Tensor), (const at::Tensor& l, const at::Tensor& b),
            "batched_cholesky_solve(Tensor L, Tensor B) -> Tensor X")

// Both at once, X = A⁻¹ B with the factor kept in cache (differentiable in Python).

/// (X [..., n, r], info int32 [...]) with X = A⁻¹ B per SPD matrix A [..., n, n] (lower triangle
/// read), factor and solves fused; X is NaN where info is nonzero. Same batch dims and dtype, no
/// broadcasting; float32 and float64 only. CPU only.
ATTN_EXT_OP(batched_spd_solve, (std::tuple<at::Tensor, at::Tensor>), (const at::Tensor& a, const at::Tensor& b),
            "batched_spd_solve(Tensor A, Tensor B) -> (Tensor X, Tensor info)")

#undef ATTN_EXT_OP
#endif  // ATTN_EXT_OP
