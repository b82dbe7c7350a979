// Typed wrappers of the CUDA attention kernels for CUDA tensors (declared in ops.h, registered in
// registration.cpp): attention_fwd / attention_bwd, with per-pair masks (causal, attn_mask) and
// grouped-query heads (AttentionMaskLayout), and cross_attention_fwd / cross_attention_bwd
// (docs/spec.md §1), their case without any of them (Hq = Hkv, no dropout). Each op validates its
// inputs with the checks its CPU op uses (csrc/checks/attention_checks.h, same messages), then both
// run the one launch code below; outputs have the CPU ops' shapes and dtypes.
//
// The band (a sliding window, the causal rule off the top-left diagonal), the soft cap and ALiBi's slopes go
// to the kernels as the AttentionMaskLayout's rules (fill_score_rules). A packed (varlen) batch (cu_seqlens_q/k)
// goes as PackedSequences: the kernels' B is the number of sequences, their M and N the longest sequence's,
// and each block reads its sequence's offsets (common/packed_sequences.h).
// What the CUDA kernels do not take raises here, naming the op and the reason, so that the Python
// dispatch can route such calls elsewhere: dropout (dropout_p > 0: NotImplementedError), float64.
// attn_mask is read in place through its strides (a broadcast mask is an expand()ed view with
// stride 0, never materialised). chunk_size is validated but otherwise unused: the kernels stream the
// keys in their own tiles, and the result does not depend on the chunking (it is the exact softmax
// either way).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "checks/attention_checks.h"
#include "checks/packed_checks.h"
#include "cuda/attention_bwd.cuh"
#include "cuda/attention_fwd.cuh"
#include "cuda/common/band_rules.h"
#include "ops.h"
#include "tensor_checks.h"

namespace attn_ext {
namespace cuda {
namespace {

using namespace bindings;  // tensor_checks.h: dtype mapping, device checks, mask bytes, launch errors

/// The unpacked inputs of a call (kept alive while the kernel's params point at them).
struct Inputs {
  at::Tensor q, k, v, padding, attn_mask;
  AttentionShape s;
  ScalarType dtype;
};

/// A cross-attention problem as the attention problem it is: as many key/value heads as query heads.
AttentionShape as_attention_shape(const CrossAttentionShape& s) {
  return AttentionShape{s.batch, s.heads, s.heads, s.queries, s.keys, s.head_dim, s.value_dim};
}

/// The checks after the op's argument checks (which gave `s`): a CUDA device, a kernel dtype, no
/// dropout; then the views the kernels read.
Inputs prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
               const AttentionShape& s, double dropout_p, const char* op) {
  Inputs in;
  in.s = s;
  check_is_cuda(q, "tensors", op);
  in.dtype = kernel_scalar_type(q.scalar_type(), op);
  TORCH_CHECK_NOT_IMPLEMENTED(dropout_p == 0.0, "attn_ext.", op, " (CUDA): dropout (dropout_p = ", dropout_p,
                              " > 0) is not implemented by the CUDA kernels; use dropout_p = 0 or another backend");
  in.q = with_unit_inner_stride(q), in.k = with_unit_inner_stride(k), in.v = with_unit_inner_stride(v);
  if (key_padding_mask.has_value()) in.padding = mask_bytes(*key_padding_mask);
  if (attn_mask.has_value()) in.attn_mask = *attn_mask;  // a view; the kernels read it through its strides
  return in;
}

/// The rules of a call beyond masks and padding, as the op received them (checked by the CPU op's checks).
struct ScoreRules {
  bool is_causal = false;
  int64_t window_left = -1, window_right = -1, diagonal = 0;
  double softcap = 0;
  at::Tensor alibi_slopes;  ///< fp32 [B, Hq] or undefined
};

ScoreRules checked_score_rules(const AttentionShape& s, const at::Tensor& q, bool is_causal, int64_t window_left,
                               int64_t window_right, int64_t diagonal, double softcap,
                               const std::optional<at::Tensor>& alibi_slopes, const char* op) {
  check_attention_band(window_left, window_right, diagonal);
  check_score_mods(s, q, softcap, alibi_slopes);
  // The kernels compute in float with c and 1 / c: a cap whose either float32 cannot hold would silently be no cap
  // (or an infinite one).
  const float cap = static_cast<float>(softcap), inverse = static_cast<float>(1.0 / softcap);
  TORCH_CHECK_VALUE(softcap == 0 || (cap > 0 && std::isfinite(cap) && std::isfinite(inverse)), "attn_ext::", op,
                    " (CUDA): softcap ", softcap, " or its inverse is outside float32's positive finite range");
  ScoreRules rules{is_causal, window_left, window_right, diagonal, softcap, {}};
  if (alibi_slopes.has_value()) rules.alibi_slopes = *alibi_slopes;
  return rules;
}

/// A packed call's checked offsets (on the host) and the same offsets on q's device, which the kernels read.
struct PackedCall {
  PackedOffsets offsets;
  at::Tensor cu_q, cu_k;  ///< int32 [S + 1] on q's device
  bool bottom_right = false;
};

/// The packed call of a call with cu_seqlens (checked as the CPU op checks it), or none; `s.batch` becomes the
/// number of sequences (ALiBi's slopes are per sequence).
std::optional<PackedCall> packed_call(const at::Tensor& q, const at::Tensor& k,
                                      const std::optional<at::Tensor>& cu_seqlens_q,
                                      const std::optional<at::Tensor>& cu_seqlens_k, bool bottom_right,
                                      int64_t diagonal, const std::optional<at::Tensor>& attn_mask,
                                      const std::optional<at::Tensor>& key_padding_mask, double dropout_p,
                                      AttentionShape& s) {
  if (!cu_seqlens_q.has_value() && !cu_seqlens_k.has_value()) {
    TORCH_CHECK_VALUE(!bottom_right, "attn_ext.scaled_dot_product_attention: bottom_right is a packed batch's "
                      "alignment; pass the diagonal offset");
    return std::nullopt;
  }
  PackedCall call;
  call.offsets = check_packed_offsets(q, k, cu_seqlens_q, cu_seqlens_k, diagonal, attn_mask, key_padding_mask,
                                      dropout_p);
  // The checked host copy goes back to the device: the kernels read what was checked.
  const auto on_device = [&](const std::vector<int32_t>& offsets) {
    return at::tensor(offsets, at::TensorOptions().dtype(at::kInt)).to(q.device());
  };
  call.cu_q = on_device(call.offsets.q), call.cu_k = on_device(call.offsets.k);
  call.bottom_right = bottom_right;
  s.batch = call.offsets.sequences();
  return call;
}

/// The layout's causal rule, band and score modifications of `rules` for M queries and N keys (common/
/// band_rules.h), or for a packed call's sequences.
void fill_score_rules(AttentionMaskLayout& p, const ScoreRules& rules, int64_t M, int64_t N,
                      const PackedCall* packed) {
  if (packed != nullptr) {
    fill_packed_band(p, rules.is_causal, rules.window_left, rules.window_right, packed->bottom_right,
                     packed->offsets.max_q, packed->offsets.max_k);
  } else {
    fill_band(p, rules.is_causal, rules.window_left, rules.window_right, rules.diagonal, M, N);
  }
  p.softcap = static_cast<float>(rules.softcap);
  p.softcap_inverse = rules.softcap > 0 ? static_cast<float>(1.0 / rules.softcap) : 0.0f;
  if (rules.alibi_slopes.defined()) {
    p.alibi_slopes = rules.alibi_slopes.const_data_ptr<float>();
    p.alibi_stride_b = rules.alibi_slopes.stride(0), p.alibi_stride_h = rules.alibi_slopes.stride(1);
  }
}

/// Fills the fields the forward and backward params share (the two structs name them alike). Without
/// attn_mask, causal or grouped heads the AttentionMaskLayout part stays at its defaults, which
/// selects the kernels without pair masks. A packed call: the sequences as the batch, the longest one's rows
/// and keys as M and N, and the device offsets.
template <typename Params>
void fill_inputs(Params& p, const Inputs& in, double scale, const ScoreRules& rules, const PackedCall* packed) {
  const AttentionShape& s = in.s;
  p.B = s.batch, p.H = s.q_heads, p.M = s.queries, p.N = s.keys, p.D = s.head_dim, p.Dv = s.value_dim;
  if (packed != nullptr) {
    p.B = packed->offsets.sequences(), p.M = packed->offsets.max_q, p.N = packed->offsets.max_k;
    p.cu_seqlens_q = packed->cu_q.const_data_ptr<int32_t>(), p.cu_seqlens_k = packed->cu_k.const_data_ptr<int32_t>();
    p.total_q = in.q.size(2), p.total_k = in.k.size(2), p.bottom_right = packed->bottom_right;
  }
  p.q = in.q.data_ptr(), p.k = in.k.data_ptr(), p.v = in.v.data_ptr();
  if (in.padding.defined()) p.key_padding_mask = in.padding.const_data_ptr<uint8_t>();
  fill_qkv_layout(p, in.q, in.k, in.v, in.padding, scale, in.dtype);
  p.kv_group = s.kv_heads > 0 ? s.q_heads / s.kv_heads : 1;  // Hq = Hkv = 0: an empty problem (no launch)
  fill_score_rules(p, rules, s.queries, s.keys, packed);
  if (in.attn_mask.defined()) {
    const at::Tensor& m = in.attn_mask;
    p.attn_mask = m.data_ptr();  // bool is one byte per element, as the kernels read it
    p.attn_mask_kind = m.scalar_type() == at::kBool ? AttnMaskKind::kBool : AttnMaskKind::kAdditive;
    p.attn_mask_stride_b = m.stride(0), p.attn_mask_stride_h = m.stride(1);
    p.attn_mask_stride_m = m.stride(2), p.attn_mask_stride_n = m.stride(3);
  }
}

/// The forward of both ops: plan, outputs, launch. `describe()` names the call's arguments in a plan error.
template <typename Describe>
std::tuple<at::Tensor, at::Tensor> launch_forward(const Inputs& in, double scale, const ScoreRules& rules,
                                                  const char* op, Describe&& describe,
                                                  const PackedCall* packed = nullptr) {
  const AttentionShape& s = in.s;
  const at::Tensor& q = in.q;
  CrossAttentionFwdParams p;
  fill_inputs(p, in, scale, rules, packed);
  const CrossAttentionLaunchPlan plan =
      plan_cross_attention_fwd(p.B, p.H, p.M, p.N, p.D, p.Dv, in.dtype, smem_limit_of(q.device(), op),
                               capability_of(q.device(), op), p.has_pair_masks());
  check_plan(plan, op, std::forward<Describe>(describe));
  at::Tensor out = at::empty({s.batch, s.q_heads, s.queries, s.value_dim}, q.options());
  at::Tensor lse = at::empty({s.batch, s.q_heads, s.queries}, q.options().dtype(accumulation_dtype(q.scalar_type())));
  if (plan.empty) return {out, lse};
  p.out = out.data_ptr(), p.lse = lse.data_ptr<float>();
  const c10::cuda::CUDAGuard guard(q.device());
  check_launch(launch_cross_attention_fwd(p, at::cuda::getCurrentCUDAStream()), op);
  return {out, lse};
}

/// The backward of both ops, after their checks of the gradients and saved outputs.
template <typename Describe>
std::tuple<at::Tensor, at::Tensor, at::Tensor> launch_backward(const Inputs& in, const at::Tensor& grad_out,
                                                               const at::Tensor& grad_lse, const at::Tensor& out,
                                                               const at::Tensor& lse, double scale,
                                                               const ScoreRules& rules, const char* op,
                                                               Describe&& describe,
                                                               const PackedCall* packed = nullptr) {
  const AttentionShape& s = in.s;
  const at::Tensor& q = in.q;
  CrossAttentionBwdParams p;
  fill_inputs(p, in, scale, rules, packed);
  const CrossAttentionBwdPlan plan =
      plan_cross_attention_bwd(p.B, p.H, p.M, p.N, p.D, p.Dv, in.dtype, smem_limit_of(q.device(), op),
                               capability_of(q.device(), op), p.kv_group);
  check_plan(plan, op, std::forward<Describe>(describe));
  const at::Tensor o = with_unit_inner_stride(out), go = with_unit_inner_stride(grad_out);
  const at::Tensor lse_c = lse.contiguous(), glse_c = grad_lse.contiguous();
  at::Tensor grad_q = at::empty({s.batch, s.q_heads, s.queries, s.head_dim}, q.options());
  at::Tensor grad_k = at::empty({s.batch, s.kv_heads, s.keys, s.head_dim}, in.k.options());
  at::Tensor grad_v = at::empty({s.batch, s.kv_heads, s.keys, s.value_dim}, in.v.options());
  at::Tensor delta =
      at::empty({s.batch, s.q_heads, s.queries}, q.options().dtype(accumulation_dtype(q.scalar_type())));
  p.out = o.data_ptr(), p.grad_out = go.data_ptr();
  p.out_stride_b = o.stride(0), p.out_stride_h = o.stride(1), p.out_stride_m = o.stride(2);
  p.dout_stride_b = go.stride(0), p.dout_stride_h = go.stride(1), p.dout_stride_m = go.stride(2);
  p.lse = lse_c.const_data_ptr<float>(), p.grad_lse = glse_c.const_data_ptr<float>();
  p.delta = delta.data_ptr<float>();
  p.grad_q = grad_q.data_ptr(), p.grad_k = grad_k.data_ptr(), p.grad_v = grad_v.data_ptr();
  const c10::cuda::CUDAGuard guard(q.device());
  check_launch(launch_cross_attention_bwd(p, at::cuda::getCurrentCUDAStream()), op);
  return {grad_q, grad_k, grad_v};
}

std::string describe_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return c10::str("q ", q.sizes(), " ", q.scalar_type(), ", k ", k.sizes(), ", v ", v.sizes());
}

std::string describe_qv(const at::Tensor& q, const at::Tensor& v) {
  return c10::str("q ", q.sizes(), " ", q.scalar_type(), ", v ", v.sizes());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      const std::optional<at::Tensor>& attn_mask,
                                                      const std::optional<at::Tensor>& key_padding_mask, double scale,
                                                      bool is_causal, double dropout_p,
                                                      const std::optional<at::Tensor>& dropout_seed,
                                                      int64_t chunk_size, int64_t window_left, int64_t window_right,
                                                      int64_t diagonal, double softcap,
                                                      const std::optional<at::Tensor>& alibi_slopes,
                                                      const std::optional<at::Tensor>& cu_seqlens_q,
                                                      const std::optional<at::Tensor>& cu_seqlens_k,
                                                      bool bottom_right) {
  const char* op = "attention_fwd";
  const AttentionShape s =
      check_attention_inputs(q, k, v, attn_mask, key_padding_mask, scale, dropout_p, dropout_seed, chunk_size);
  AttentionShape rules_shape = s;  // ALiBi's slopes count a packed call's sequences
  const std::optional<PackedCall> packed = packed_call(q, k, cu_seqlens_q, cu_seqlens_k, bottom_right, diagonal,
                                                       attn_mask, key_padding_mask, dropout_p, rules_shape);
  const ScoreRules rules =
      checked_score_rules(rules_shape, q, is_causal, window_left, window_right, diagonal, softcap, alibi_slopes, op);
  const Inputs in = prepare(q, k, v, attn_mask, key_padding_mask, s, dropout_p, op);
  return launch_forward(in, scale, rules, op, [&] { return describe_qkv(q, k, v); }, packed ? &*packed : nullptr);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
    const at::Tensor& out, const at::Tensor& lse, double scale, bool is_causal, double dropout_p,
    const std::optional<at::Tensor>& dropout_seed, int64_t chunk_size, int64_t window_left, int64_t window_right,
    int64_t diagonal, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k, bool bottom_right) {
  const char* op = "attention_bwd";
  const AttentionShape s =
      check_attention_inputs(q, k, v, attn_mask, key_padding_mask, scale, dropout_p, dropout_seed, chunk_size);
  AttentionShape rules_shape = s;  // ALiBi's slopes count a packed call's sequences
  const std::optional<PackedCall> packed = packed_call(q, k, cu_seqlens_q, cu_seqlens_k, bottom_right, diagonal,
                                                       attn_mask, key_padding_mask, dropout_p, rules_shape);
  const ScoreRules rules =
      checked_score_rules(rules_shape, q, is_causal, window_left, window_right, diagonal, softcap, alibi_slopes, op);
  const Inputs in = prepare(q, k, v, attn_mask, key_padding_mask, s, dropout_p, op);
  check_attention_grads(s, q, grad_out, grad_lse, out, lse);
  return launch_backward(in, grad_out, grad_lse, out, lse, scale, rules, op, [&] { return describe_qkv(q, k, v); },
                         packed ? &*packed : nullptr);
}

std::tuple<at::Tensor, at::Tensor> cross_attention_fwd_cuda(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v,
                                                            const std::optional<at::Tensor>& key_padding_mask,
                                                            double scale, int64_t chunk_size) {
  const char* op = "cross_attention_fwd";
  const CrossAttentionShape s = check_cross_attention_inputs(q, k, v, key_padding_mask, scale, chunk_size);
  const Inputs in = prepare(q, k, v, std::nullopt, key_padding_mask, as_attention_shape(s), 0.0, op);
  return launch_forward(in, scale, ScoreRules{}, op, [&] { return describe_qv(q, v); });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_attention_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const std::optional<at::Tensor>& key_padding_mask, const at::Tensor& out,
    const at::Tensor& lse, double scale, int64_t chunk_size) {
  const char* op = "cross_attention_bwd";
  const CrossAttentionShape s = check_cross_attention_inputs(q, k, v, key_padding_mask, scale, chunk_size);
  const Inputs in = prepare(q, k, v, std::nullopt, key_padding_mask, as_attention_shape(s), 0.0, op);
  check_cross_attention_grads(s, q, grad_out, grad_lse, out, lse);
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{grad_out, "grad_out"},
                                {grad_lse, "grad_lse"}, {out, "out"}, {lse, "lse"}}) {
    check_on_device(t, name, q.device(), op);
  }
  return launch_backward(in, grad_out, grad_lse, out, lse, scale, ScoreRules{}, op, [&] { return describe_qv(q, v); });
}

}  // namespace cuda
}  // namespace attn_ext
