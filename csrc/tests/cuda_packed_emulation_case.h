// The packed (varlen) emulation cases of the attention kernels, forward and backward: sequences of uneven
// lengths (empty ones too) packed as the op lays them out (q [total_q, H, D] rows read as [1, H, total_q, D],
// k and v [total_k, Hkv, ·]; padded rows, and NaN in every element no sequence owns, the two rows past
// total_k included), the band and ALiBi of each sequence its own (aligned top-left or bottom-right; the
// layout's sides set by fill_packed_band, as the binding sets them), ALiBi slopes per sequence, and a double
// reference computed one sequence at a time. Outputs and gradients are surrounded by sentinels: a block that
// wrote past its sequence, or missed a row, fails. Used by the four attention emulation mains (SIMT, WMMA and
// mma.sync, forward and backward) through their kernels' launch functors.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "attention_bwd.cuh"
#include "attention_fwd.cuh"
#include "common/band_rules.h"
#include "cuda_emulation/emulator_extras_tree.h"  // smem_raw, run_grid
#include "cuda_emulation/scalar_types.h"

namespace packed_emulation {

inline int g_failures = 0;
inline constexpr double kInf = std::numeric_limits<double>::infinity();

struct PackedCase {
  const char* name;
  std::vector<int64_t> q_lens, k_lens;  ///< per sequence
  int64_t H, D, Dv;
  int64_t kv_group = 1;
  bool causal = false, bottom_right = false;
  int64_t window_left = -1, window_right = -1;
  float softcap = 0;
  float alibi = 0;  ///< sequence s, query head h: slope alibi·(h + 1)·(s + 1); 0: none
  bool aligned = false;  ///< rows on 16-byte boundaries (the mma kernels' requirement)

  bool pair_masks() const {
    return causal || window_left >= 0 || window_right >= 0 || softcap > 0 || alibi != 0;
  }
};

inline float as_float(float x) { return x; }
inline float as_float(__half x) { return __half2float(x); }
inline float as_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

inline void fail(const PackedCase& c, const char* what, int64_t index, double got, double want) {
  if (++g_failures <= 20) {
    std::fprintf(stderr, "[%s] %s at %lld: got %.9g want %.9g\n", c.name, what, static_cast<long long>(index), got,
                 want);
  }
}

inline bool differs(double got, double want, double tol) {
  if (std::isnan(want)) return !std::isnan(got);
  if (std::isinf(want)) return got != want;
  return !(std::fabs(got - want) <= tol * (1 + std::fabs(want)));
}

/// A packed problem's inputs, offsets and per-sequence reference rules.
template <typename scalar_t>
struct PackedProblem {
  const PackedCase& c;
  int64_t S, H, Hkv, D, Dv, total_q, total_k, max_q = 0, max_k = 0;
  int64_t q_row, k_row, v_row;  ///< elements between packed rows (H·(D + pad) etc.)
  int64_t q_head, k_head, v_head;
  std::vector<int32_t> cu_q, cu_k;
  std::vector<scalar_t> q, k, v;
  std::vector<float> slopes;  ///< [S, H]
  float scale;

  PackedProblem(const PackedCase& c_, uint32_t seed) : c(c_) {
    S = static_cast<int64_t>(c.q_lens.size()), H = c.H, Hkv = c.H / c.kv_group, D = c.D, Dv = c.Dv;
    cu_q.assign(1, 0), cu_k.assign(1, 0);
    for (int64_t s = 0; s < S; ++s) {
      cu_q.push_back(cu_q.back() + static_cast<int32_t>(c.q_lens[s]));
      cu_k.push_back(cu_k.back() + static_cast<int32_t>(c.k_lens[s]));
      max_q = std::max(max_q, c.q_lens[s]), max_k = std::max(max_k, c.k_lens[s]);
    }
    total_q = cu_q.back(), total_k = cu_k.back();
    const int64_t pad = c.aligned ? 8 : 3;
    q_head = D + pad, k_head = D + pad + (c.aligned ? 8 : 2), v_head = Dv + pad;
    q_row = H * q_head, k_row = Hkv * k_head, v_row = Hkv * v_head;
    const scalar_t nan = from_float<scalar_t>(std::numeric_limits<float>::quiet_NaN());
    q.assign(total_q * q_row + 1, nan), k.assign((total_k + 2) * k_row + 1, nan), v.assign((total_k + 2) * v_row + 1, nan);
    std::mt19937 gen(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int64_t r = 0; r < total_q; ++r)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) q[r * q_row + h * q_head + d] = from_float<scalar_t>(normal(gen));
    for (int64_t r = 0; r < total_k; ++r)
      for (int64_t h = 0; h < Hkv; ++h) {
        for (int64_t d = 0; d < D; ++d) k[r * k_row + h * k_head + d] = from_float<scalar_t>(normal(gen));
        for (int64_t d = 0; d < Dv; ++d) v[r * v_row + h * v_head + d] = from_float<scalar_t>(normal(gen));
      }
    slopes.assign(S * H, 0.0f);
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h) slopes[s * H + h] = c.alibi * static_cast<float>((h + 1) * (s + 1));
    scale = 1.0f / std::sqrt(static_cast<float>(D));
  }

  /// The layout every packed call shares: strides, offsets, the band (as the binding sets it), ALiBi.
  template <typename Params>
  void fill(Params& p) const {
    p.B = S, p.H = H, p.M = max_q, p.N = max_k, p.D = D, p.Dv = Dv;
    p.q = q.data(), p.k = k.data(), p.v = v.data();
    p.q_stride_b = 0, p.q_stride_h = q_head, p.q_stride_m = q_row;
    p.k_stride_b = 0, p.k_stride_h = k_head, p.k_stride_n = k_row;
    p.v_stride_b = 0, p.v_stride_h = v_head, p.v_stride_n = v_row;
    p.scale = scale, p.dtype = cuda_emu::scalar_type<scalar_t>(), p.kv_group = c.kv_group;
    p.cu_seqlens_q = cu_q.data(), p.cu_seqlens_k = cu_k.data();
    p.total_q = total_q, p.total_k = total_k, p.bottom_right = c.bottom_right;
    attn_ext::cuda::fill_packed_band(p, c.causal, c.window_left, c.window_right, c.bottom_right, max_q, max_k);
    p.softcap = c.softcap, p.softcap_inverse = c.softcap > 0 ? 1.0f / c.softcap : 0.0f;
    if (c.alibi != 0) p.alibi_slopes = slopes.data(), p.alibi_stride_b = H, p.alibi_stride_h = 1;
  }

  double qv(int64_t s, int64_t h, int64_t m, int64_t d) const { return as_float(q[(cu_q[s] + m) * q_row + h * q_head + d]); }
  double kv(int64_t s, int64_t h, int64_t n, int64_t d) const { return as_float(k[(cu_k[s] + n) * k_row + h * k_head + d]); }
  double vv(int64_t s, int64_t h, int64_t n, int64_t d) const { return as_float(v[(cu_k[s] + n) * v_row + h * v_head + d]); }
  int64_t diagonal(int64_t s) const { return c.bottom_right ? c.k_lens[s] - c.q_lens[s] : 0; }
  bool allowed(int64_t s, int64_t m, int64_t n) const {
    const int64_t i = m + diagonal(s);
    if (c.causal && n > i) return false;
    if (c.window_left >= 0 && n < i - c.window_left) return false;
    if (c.window_right >= 0 && n > i + c.window_right) return false;
    return true;
  }
  double dot(int64_t s, int64_t h, int64_t m, int64_t n) const {
    double x = 0;
    for (int64_t d = 0; d < D; ++d) x += qv(s, h, m, d) * kv(s, h / c.kv_group, n, d);
    return x;
  }
  /// The score of an allowed pair (−inf for a masked one).
  double score(int64_t s, int64_t h, int64_t m, int64_t n) const {
    if (!allowed(s, m, n)) return -kInf;
    double x = dot(s, h, m, n) * double(scale);
    if (c.softcap > 0) x = double(c.softcap) * std::tanh(x / double(c.softcap));
    return x - double(slopes[s * H + h]) * double(std::llabs(m + diagonal(s) - n));
  }
  double score_slope(int64_t s, int64_t h, int64_t m, int64_t n) const {
    if (!(c.softcap > 0)) return 1.0;
    const double t = std::tanh(dot(s, h, m, n) * double(scale) / double(c.softcap));
    return 1.0 - t * t;
  }
  /// Row m of (s, h): lse and the softmax weights (NaN-free inputs here).
  double row_lse(int64_t s, int64_t h, int64_t m) const {
    double mx = -kInf;
    for (int64_t n = 0; n < c.k_lens[s]; ++n) mx = std::max(mx, score(s, h, m, n));
    if (mx == -kInf) return -kInf;
    double sum = 0;
    for (int64_t n = 0; n < c.k_lens[s]; ++n) sum += std::exp(score(s, h, m, n) - mx);
    return mx + std::log(sum);
  }
};

template <typename scalar_t>
double tolerance(double fp32, double fp16, double bf16) {
  return sizeof(scalar_t) == 4 ? fp32 : (cuda_emu::scalar_type<scalar_t>() == attn_ext::ScalarType::kFloat16 ? fp16 : bf16);
}

constexpr int64_t kGuard = 29;
constexpr float kSentinel = 12288.0f;  // exact in fp16 and bf16

/// Runs the forward: `grid(p)` the launch (grid, block, smem bytes; grid 0 = refused), `kernel(p)` one block.
template <typename scalar_t, typename Grid, typename Kernel>
void run_packed_forward(const PackedCase& c, uint32_t seed, Grid grid, Kernel kernel) {
  const PackedProblem<scalar_t> pb(c, seed);
  attn_ext::cuda::CrossAttentionFwdParams p;
  pb.fill(p);
  const int64_t H = pb.H, Dv = pb.Dv, T = pb.total_q;
  std::vector<scalar_t> out(H * T * Dv + 2 * kGuard, from_float<scalar_t>(kSentinel));
  std::vector<float> lse(H * T + 2 * kGuard, kSentinel);
  p.out = out.data() + kGuard, p.lse = lse.data() + kGuard;
  unsigned int blocks = 0, threads = 0;
  std::size_t smem_bytes = 0;
  grid(p, &blocks, &threads, &smem_bytes);
  if (blocks == 0 && pb.S * H * pb.max_q > 0) return fail(c, "the launch was refused", 0, 0, 0);
  void* smem = attn_ext::cuda::detail::smem_raw;
  if (!cuda_emu::run_grid(dim3(blocks), dim3(threads), smem, sizeof(attn_ext::cuda::detail::smem_raw), smem_bytes,
                          [&] { kernel(p); })) {
    fail(c, "shared memory written past the planned size", 0, 0, 0);
  }
  for (int64_t i = 0; i < kGuard; ++i) {
    if (as_float(out[i]) != kSentinel || as_float(out[out.size() - 1 - i]) != kSentinel) fail(c, "out guard", i, 0, 0);
    if (lse[i] != kSentinel || lse[lse.size() - 1 - i] != kSentinel) fail(c, "lse guard", i, 0, 0);
  }
  const double tol = tolerance<scalar_t>(2e-5, 2e-3, 1e-2);
  for (int64_t s = 0; s < pb.S; ++s)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t m = 0; m < c.q_lens[s]; ++m) {
        const int64_t row = h * T + pb.cu_q[s] + m;
        const double want_lse = pb.row_lse(s, h, m);
        if (differs(p.lse[row], want_lse, 1e-4)) fail(c, "lse", row, p.lse[row], want_lse);
        for (int64_t d = 0; d < Dv; ++d) {
          double o = 0;
          for (int64_t n = 0; n < c.k_lens[s] && want_lse > -kInf; ++n) {
            if (pb.allowed(s, m, n)) o += std::exp(pb.score(s, h, m, n) - want_lse) * pb.vv(s, h / c.kv_group, n, d);
          }
          const double got = as_float(static_cast<const scalar_t*>(p.out)[row * Dv + d]);
          if (differs(got, o, tol)) fail(c, "out", row * Dv + d, got, o);
        }
      }
  std::printf("  %-56s grid=%u ok=%s\n", c.name, blocks, g_failures == 0 ? "yes" : "NO");
}

/// Runs the backward: `kernels(p)` the Δ pre-pass and both gradient kernels (false: shared memory written past
/// a plan), from out and lse saved as the op would (out in the dtype, lse in fp32).
template <typename scalar_t, typename Kernels>
void run_packed_backward(const PackedCase& c, uint32_t seed, Kernels kernels) {
  const PackedProblem<scalar_t> pb(c, seed);
  const int64_t S = pb.S, H = pb.H, Hkv = pb.Hkv, D = pb.D, Dv = pb.Dv, T = pb.total_q, K = pb.total_k;
  std::mt19937 gen(seed + 1000);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // out and dO as [1, H, total_q, Dv] views with padded rows; lse, dlse [H, total_q].
  const int64_t o_row = Dv + (c.aligned ? 8 : 3);
  std::vector<scalar_t> out(H * T * o_row + 1, from_float<scalar_t>(std::numeric_limits<float>::quiet_NaN()));
  std::vector<scalar_t> dout(out.size(), out[0]);
  std::vector<float> lse(H * T), dlse(H * T);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t m = 0; m < c.q_lens[s]; ++m) {
        const int64_t row = h * T + pb.cu_q[s] + m;
        const double l = pb.row_lse(s, h, m);
        lse[row] = static_cast<float>(l), dlse[row] = normal(gen);
        for (int64_t d = 0; d < Dv; ++d) {
          double o = 0;
          for (int64_t n = 0; n < c.k_lens[s] && l > -kInf; ++n) {
            if (pb.allowed(s, m, n)) o += std::exp(pb.score(s, h, m, n) - l) * pb.vv(s, h / c.kv_group, n, d);
          }
          out[row * o_row + d] = from_float<scalar_t>(static_cast<float>(o));
          dout[row * o_row + d] = from_float<scalar_t>(normal(gen));
        }
      }
  attn_ext::cuda::CrossAttentionBwdParams p;
  pb.fill(p);
  p.out = out.data(), p.grad_out = dout.data();
  p.out_stride_b = 0, p.out_stride_h = T * o_row, p.out_stride_m = o_row;
  p.dout_stride_b = 0, p.dout_stride_h = T * o_row, p.dout_stride_m = o_row;
  p.lse = lse.data(), p.grad_lse = dlse.data();
  std::vector<float> delta(H * T + 1, std::numeric_limits<float>::quiet_NaN());
  const scalar_t sentinel = from_float<scalar_t>(kSentinel);
  std::vector<scalar_t> dq(H * T * D + 2 * kGuard, sentinel), dk(Hkv * K * D + 2 * kGuard, sentinel),
      dv(Hkv * K * Dv + 2 * kGuard, sentinel);
  p.delta = delta.data(), p.grad_q = dq.data() + kGuard, p.grad_k = dk.data() + kGuard, p.grad_v = dv.data() + kGuard;
  if (!kernels(p)) fail(c, "shared memory written past the planned size", 0, 0, 0);
  for (const auto* g : {&dq, &dk, &dv}) {
    for (int64_t i = 0; i < kGuard; ++i) {
      if (as_float((*g)[i]) != kSentinel || as_float((*g)[g->size() - 1 - i]) != kSentinel) {
        fail(c, "gradient guard", i, 0, 0);
      }
    }
  }
  std::vector<double> rq(H * T * D, 0.0), rk(Hkv * K * D, 0.0), rv(Hkv * K * Dv, 0.0);
  const double sc = double(pb.scale);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t m = 0; m < c.q_lens[s]; ++m) {
        const int64_t row = h * T + pb.cu_q[s] + m;
        if (std::isinf(lse[row])) continue;
        double dd = 0;
        for (int64_t d = 0; d < Dv; ++d) dd += double(as_float(dout[row * o_row + d])) * as_float(out[row * o_row + d]);
        for (int64_t n = 0; n < c.k_lens[s]; ++n) {
          if (!pb.allowed(s, m, n)) continue;
          const double prob = std::exp(pb.score(s, h, m, n) - double(lse[row]));
          double dp = 0;
          for (int64_t d = 0; d < Dv; ++d) dp += double(as_float(dout[row * o_row + d])) * pb.vv(s, h / c.kv_group, n, d);
          const double ds = prob * (dp - dd + dlse[row]) * pb.score_slope(s, h, m, n);
          const int64_t key = (h / c.kv_group) * K + pb.cu_k[s] + n;
          for (int64_t d = 0; d < Dv; ++d) rv[key * Dv + d] += prob * as_float(dout[row * o_row + d]);
          for (int64_t d = 0; d < D; ++d) {
            rk[key * D + d] += sc * ds * pb.qv(s, h, m, d);
            rq[row * D + d] += sc * ds * pb.kv(s, h / c.kv_group, n, d);
          }
        }
      }
  const double tol = tolerance<scalar_t>(1e-4, 3e-3, 2e-2);
  const auto compare = [&](const char* what, const std::vector<scalar_t>& got, const std::vector<double>& want) {
    double magnitude = 0;
    for (double w : want) magnitude = std::max(magnitude, std::fabs(w));
    for (size_t i = 0; i < want.size(); ++i) {
      const double g = as_float(got[kGuard + i]);
      if (!(std::fabs(g - want[i]) <= tol * (std::fabs(want[i]) + 0.1 * magnitude + 1e-6))) {
        fail(c, what, static_cast<int64_t>(i), g, want[i]);
      }
    }
  };
  compare("grad_q", dq, rq);
  compare("grad_k", dk, rk);
  compare("grad_v", dv, rv);
  std::printf("  %-56s ok=%s\n", c.name, g_failures == 0 ? "yes" : "NO");
}

/// The packed cases every kernel family runs (`aligned` set by the mma mains): uneven lengths with empty
/// sequences (no queries; no keys: out 0, lse −inf), the causal rule top-left and bottom-right (sequences with
/// more queries than keys: rows before the diagonal have no key), a bottom-right window with soft cap and
/// per-sequence ALiBi, a two-sided window, GQA, a window over long sequences (tiles outside each band skipped);
/// head dims D and Dv (a family's bucket).
inline std::vector<PackedCase> packed_cases(int64_t D, int64_t Dv) {
  std::vector<PackedCase> cases;
  cases.push_back({"packed: lengths 37/0/5/70, no rules", {37, 0, 5, 70}, {45, 9, 0, 66}, 2, D, Dv});
  PackedCase causal{"packed: causal top-left, GQA 4/2", {20, 33, 1, 0}, {20, 50, 7, 3}, 4, D, Dv, 2, true};
  cases.push_back(causal);
  PackedCase bottom{"packed: causal bottom-right, M > N in one", {16, 40, 3}, {70, 25, 3}, 2, D, Dv, 1, true, true};
  cases.push_back(bottom);
  PackedCase window{"packed: window (9, 0) bottom-right + softcap + ALiBi", {30, 12, 0, 41},
                    {80, 12, 5, 41}, 2, D, Dv, 1, true, true, 9, -1, 4.0f, 0.125f};
  cases.push_back(window);
  PackedCase two_sided{"packed: window (4, 6) top-left, GQA 2/1", {25, 66}, {40, 30}, 2, D, Dv, 2, false, false, 4, 6};
  cases.push_back(two_sided);
  // Long sequences: the query tiles (dK/dV) and key tiles (forward, dQ) outside each sequence's band skipped.
  PackedCase long_band{"packed: window (20, 0) bottom-right, long keys", {150, 3}, {300, 200}, 1, D, Dv, 1, true, true,
                       20};
  cases.push_back(long_band);
  return cases;
}

}  // namespace packed_emulation
