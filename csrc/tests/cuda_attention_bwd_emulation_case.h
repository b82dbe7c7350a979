// The backward emulation tests' common part: a case's inputs (strided views with NaN in every element the
// kernels must not read, the rows past N; the last batch's keys all padding when masked; nonzero
// grad_lse; NaN in padded keys' k and v rows and in a query element; attn_mask views with a NaN key and a
// NaN query row masked for every pair that reads them), the forward saved as the op would (out in the
// input dtype, lse in fp32), the kernels run by a caller-given launcher, and the double reference of
// docs/spec.md §1's backward. Used by cuda_attention_bwd_emulation_test.cpp (SIMT and WMMA kernels) and
// cuda_attention_bwd_mma_emulation_test.cpp (the mma.sync kernels).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "attention_bwd.cuh"
#include "cuda_emulation/emulator_extras_tree.h"
#include "cuda_emulation/scalar_types.h"
#include "cuda_score_rules_case.h"

namespace bwd_emulation {

using attn_ext::cuda::CrossAttentionBwdParams;
using attn_ext::cuda::CrossAttentionBwdPlan;
using attn_ext::ScalarType;
using attn_ext::cuda::detail::from_float;
using attn_ext::cuda::detail::to_float;

inline int g_failures = 0;
inline constexpr double kInf = std::numeric_limits<double>::infinity();

using cuda_emu::scalar_type;

/// attn_mask of a case: none, bool (True = take part) or additive in the inputs' dtype.
enum AttnMask { kNoAttnMask, kBoolMask, kAdditiveMask };

struct Case {
  const char* name;
  int64_t B, H, M, N, D, Dv;
  bool mask;
  // attention_bwd's additions (the pair-mask instantiations run when causal or attn_mask is set).
  bool causal = false;
  AttnMask attn_mask = kNoAttnMask;
  int64_t kv_group = 1;  // query heads per key/value head
  // Rows padded by 8 elements (16 bytes) instead of 3, as the mma kernels' cp.async loads need.
  bool aligned = false;
  emulation_rules::ScoreRules rules{};  // a band, soft cap, ALiBi (pair-mask instantiations too)
};

inline void fail(const Case& c, const char* what, int64_t index, double got, double want) {
  if (++g_failures <= 20) {
    std::fprintf(stderr, "[%s] %s at %lld: got %.9g want %.9g\n", c.name, what, static_cast<long long>(index), got,
                 want);
  }
}

/// A [B, H, rows, cols] tensor stored with padded rows (stride cols + pad), NaN outside the logical view.
template <typename T>
struct Strided {
  int64_t H, rows, cols, stride_m, stride_h, stride_b;
  std::vector<T> data;
  Strided(int64_t B, int64_t H_, int64_t rows_, int64_t cols_, int64_t pad = 3)
      : H(H_), rows(rows_), cols(cols_), stride_m(cols_ + pad), stride_h((rows_ + 2) * (cols_ + pad)),
        stride_b(H_ * (rows_ + 2) * (cols_ + pad)),
        data(static_cast<size_t>(B * stride_b + 1), from_float<T>(std::numeric_limits<float>::quiet_NaN())) {}
  T& at(int64_t b, int64_t h, int64_t r, int64_t c) { return data[b * stride_b + h * stride_h + r * stride_m + c]; }
  double get(int64_t b, int64_t h, int64_t r, int64_t c) { return to_float(at(b, h, r, c)); }
};

/// sm_90's opt-in shared memory per block: plans keep their preferred tiles.
inline constexpr std::size_t kSm90 = 232448;
/// The compute capability the plans are given: one whose tensor cores take every dtype, so that the
/// emulator also runs the bf16 kernels with the fall-back tiles of smaller shared-memory limits.
constexpr int kEveryDtypeCapability = 90;

/// Builds one case (see the file comment), runs `kernels(p)` (the Δ pre-pass and both gradient kernels
/// under the emulator; false when one wrote shared memory past its plan) and compares the gradients with
/// the reference.
template <typename scalar_t, typename Kernels>
void run_backward_case(const Case& c, uint32_t seed, Kernels kernels) {
  const int64_t B = c.B, H = c.H, M = c.M, N = c.N, D = c.D, Dv = c.Dv;
  const int64_t group = c.kv_group, Hkv = H / group;  // query head h reads key/value head h / group
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t pad = c.aligned ? 8 : 3;
  Strided<scalar_t> q(B, H, M, D, pad), k(B, Hkv, N, D, pad), v(B, Hkv, N, Dv, pad), out(B, H, M, Dv, pad),
      dout(B, H, M, Dv, pad);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t d = 0; d < D; ++d) q.at(b, h, m, d) = from_float<scalar_t>(normal(gen));
        for (int64_t d = 0; d < Dv; ++d) dout.at(b, h, m, d) = from_float<scalar_t>(normal(gen));
      }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t n = 0; n < N; ++n) {
        for (int64_t d = 0; d < D; ++d) k.at(b, h, n, d) = from_float<scalar_t>(normal(gen));
        for (int64_t d = 0; d < Dv; ++d) v.at(b, h, n, d) = from_float<scalar_t>(normal(gen));
      }
  std::vector<uint8_t> mask(static_cast<size_t>(B * (N + 5)), 1);
  std::bernoulli_distribution padded(0.3);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = 0; n < N; ++n) mask[b * (N + 5) + n] = c.mask && (b == B - 1 || padded(gen)) ? 1 : 0;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const float scale_f = static_cast<float>(scale);
  if (c.mask) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t n = 0; n < N; ++n) {
        if (!mask[b * (N + 5) + n]) continue;
        for (int64_t h = 0; h < Hkv; ++h) {
          for (int64_t d = 0; d < D; ++d) k.at(b, h, n, d) = from_float<scalar_t>(nan);
          for (int64_t d = 0; d < Dv; ++d) v.at(b, h, n, d) = from_float<scalar_t>(nan);
        }
      }
    if (M > 0) q.at(0, 0, M - 1, 0) = from_float<scalar_t>(nan);
  }
  // attn_mask as a strided view (as the forward test): bool [1 → B, H, M, N] stored transposed with
  // the batch broadcast, additive [B, 1 → H, M, N + 2] with the head broadcast; ~30% of the pairs
  // masked, all of query row 1 (an empty row), and key N / 2 of batch 0's first key/value head for
  // every query row that reads it: its k and v rows are NaN. Query row 2 of (0, 0) is NaN too and
  // masked for every key: an empty row whose NaN must reach neither dK nor dV (exact products).
  std::vector<uint8_t> bool_mask;
  std::vector<scalar_t> add_mask;
  int64_t am_b = 0, am_h = 0, am_m = 0, am_n = 0;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t nan_key = c.attn_mask != kNoAttnMask && N > 0 ? N / 2 : -1;
  const int64_t nan_query = c.attn_mask != kNoAttnMask && M > 2 ? 2 : -1;
  if (c.attn_mask != kNoAttnMask) {
    std::bernoulli_distribution dropped(0.3);
    const bool is_bool = c.attn_mask == kBoolMask;
    if (is_bool) {
      am_b = 0, am_h = N * (M + 1), am_m = 1, am_n = M + 1;
      bool_mask.assign(H * N * (M + 1) + 1, 7);  // nonzero padding bytes: a stray read would unmask
    } else {
      am_b = M * (N + 2), am_h = 0, am_m = N + 2, am_n = 1;
      add_mask.assign(B * M * (N + 2) + 1, from_float<scalar_t>(nan));
    }
    for (int64_t b = 0; b < (is_bool ? 1 : B); ++b)
      for (int64_t h = 0; h < (is_bool ? H : 1); ++h)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < N; ++n) {
            // The NaN query row (2) is emptied for the head(s) the NaN is in.
            const bool off = dropped(gen) || m == 1 || (m == nan_query && (is_bool ? h == 0 : b == 0)) ||
                             (n == nan_key && (is_bool ? h < group : b == 0));
            const int64_t at = b * am_b + h * am_h + m * am_m + n * am_n;
            if (is_bool) {
              bool_mask[at] = off ? 0 : 1;
            } else {
              add_mask[at] = from_float<scalar_t>(off ? -std::numeric_limits<float>::infinity() : 0.5f * normal(gen));
            }
          }
    if (nan_key >= 0) {
      for (int64_t d = 0; d < D; ++d) k.at(0, 0, nan_key, d) = from_float<scalar_t>(nan);
      for (int64_t d = 0; d < Dv; ++d) v.at(0, 0, nan_key, d) = from_float<scalar_t>(nan);
    }
    if (nan_query >= 0) {
      for (int64_t d = 0; d < D; ++d) q.at(0, 0, nan_query, d) = from_float<scalar_t>(nan);
    }
  }
  const auto allowed = [&](int64_t b, int64_t h, int64_t m, int64_t n) {
    if (mask[b * (N + 5) + n]) return false;
    if (c.causal && n > m) return false;
    if (!c.rules.in_band(m, n)) return false;
    const int64_t at = b * am_b + h * am_h + m * am_m + n * am_n;
    if (c.attn_mask == kBoolMask) return bool_mask[at] != 0;
    if (c.attn_mask == kAdditiveMask) return !std::isinf(to_float(add_mask[at]));
    return true;
  };
  const auto additive = [&](int64_t b, int64_t h, int64_t m, int64_t n) {
    return c.attn_mask == kAdditiveMask ? double(to_float(add_mask[b * am_b + h * am_h + m * am_m + n * am_n])) : 0.0;
  };

  // The forward in double, saved as the op would: out in the input dtype, lse in fp32.
  std::vector<float> lse(B * H * M), grad_lse(B * H * M);
  std::vector<double> s(N);
  const auto score = [&](int64_t b, int64_t h, int64_t m, int64_t n) {
    if (!allowed(b, h, m, n)) return -kInf;  // masked pairs are never read
    double dot = 0;
    for (int64_t d = 0; d < D; ++d) dot += q.get(b, h, m, d) * k.get(b, h / group, n, d);
    return c.rules.score(dot * double(scale_f), additive(b, h, m, n), h, m, n);
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t m = 0; m < M; ++m) {
        const int64_t row = (b * H + h) * M + m;
        double mx = -kInf;
        for (int64_t n = 0; n < N; ++n) {
          s[n] = score(b, h, m, n);
          mx = std::isnan(s[n]) || std::isnan(mx) ? s[n] + mx : std::max(mx, s[n]);  // NaN-propagating max
        }
        double sum = 0;
        for (int64_t n = 0; n < N && mx > -kInf; ++n) sum += std::exp(s[n] - mx);
        lse[row] = mx == -kInf ? -std::numeric_limits<float>::infinity() : static_cast<float>(mx + std::log(sum));
        grad_lse[row] = normal(gen);
        for (int64_t d = 0; d < Dv; ++d) {
          double o = 0;
          for (int64_t n = 0; n < N && mx != -kInf; ++n) {
            if (allowed(b, h, m, n)) o += std::exp(s[n] - mx) / sum * v.get(b, h / group, n, d);  // masked: never read
          }
          out.at(b, h, m, d) = from_float<scalar_t>(static_cast<float>(o));
        }
      }

  CrossAttentionBwdParams p;
  p.B = B, p.H = H, p.M = M, p.N = N, p.D = D, p.Dv = Dv, p.scale = scale_f, p.dtype = scalar_type<scalar_t>();
  p.kv_group = group, p.causal = c.causal;
  std::vector<float> slopes;
  c.rules.apply(p, H, slopes);
  if (c.attn_mask != kNoAttnMask) {
    p.attn_mask = c.attn_mask == kBoolMask ? static_cast<const void*>(bool_mask.data())
                                           : static_cast<const void*>(add_mask.data());
    p.attn_mask_kind = c.attn_mask == kBoolMask ? attn_ext::cuda::AttnMaskKind::kBool
                                                : attn_ext::cuda::AttnMaskKind::kAdditive;
    p.attn_mask_stride_b = am_b, p.attn_mask_stride_h = am_h, p.attn_mask_stride_m = am_m, p.attn_mask_stride_n = am_n;
  }
  p.q = q.data.data(), p.k = k.data.data(), p.v = v.data.data(), p.out = out.data.data(), p.grad_out = dout.data.data();
  p.q_stride_b = q.stride_b, p.q_stride_h = q.stride_h, p.q_stride_m = q.stride_m;
  p.k_stride_b = k.stride_b, p.k_stride_h = k.stride_h, p.k_stride_n = k.stride_m;
  p.v_stride_b = v.stride_b, p.v_stride_h = v.stride_h, p.v_stride_n = v.stride_m;
  p.out_stride_b = out.stride_b, p.out_stride_h = out.stride_h, p.out_stride_m = out.stride_m;
  p.dout_stride_b = dout.stride_b, p.dout_stride_h = dout.stride_h, p.dout_stride_m = dout.stride_m;
  p.key_padding_mask = mask.data(), p.mask_stride_b = N + 5;
  p.lse = lse.data(), p.grad_lse = grad_lse.data();
  std::vector<float> delta(B * H * M, std::numeric_limits<float>::quiet_NaN());
  const scalar_t sentinel = from_float<scalar_t>(12288.0f);
  std::vector<scalar_t> dq(B * H * M * D + 1, sentinel), dk(B * Hkv * N * D + 1, sentinel),
      dv(B * Hkv * N * Dv + 1, sentinel);
  p.delta = delta.data(), p.grad_q = dq.data(), p.grad_k = dk.data(), p.grad_v = dv.data();

  const bool ok = kernels(p);
  if (g_failures > 0 && !ok) return;
  if (!ok) fail(c, "shared memory written past the planned size", 0, 0, 0);
  if (to_float(dq.back()) != 12288.0f || to_float(dk.back()) != 12288.0f || to_float(dv.back()) != 12288.0f)
    fail(c, "write past the end of a gradient", 0, 0, 0);

  // Reference gradients from the saved out/lse (docs/spec.md §1): P = exp(s − lse), Δ = dO·o.
  std::vector<double> rq(B * H * M * D, 0.0), rk(B * Hkv * N * D, 0.0), rv(B * Hkv * N * Dv, 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t m = 0; m < M; ++m) {
        const int64_t row = (b * H + h) * M + m;
        if (std::isinf(lse[row])) continue;
        double dd = 0;
        for (int64_t d = 0; d < Dv; ++d) dd += dout.get(b, h, m, d) * out.get(b, h, m, d);
        for (int64_t n = 0; n < N; ++n) {
          const double sc = score(b, h, m, n);
          if (!allowed(b, h, m, n)) continue;
          const double prob = std::exp(sc - double(lse[row]));
          double dp = 0;
          for (int64_t d = 0; d < Dv; ++d) dp += dout.get(b, h, m, d) * v.get(b, h / group, n, d);
          double dot = 0;  // the soft cap's factor of dS
          for (int64_t d = 0; d < D; ++d) dot += q.get(b, h, m, d) * k.get(b, h / group, n, d);
          const double ds = prob * (dp - dd + grad_lse[row]) * c.rules.score_slope(dot * double(scale_f));
          const int64_t key = (b * Hkv + h / group) * N + n;  // GQA: the group's query heads sum here
          for (int64_t d = 0; d < Dv; ++d) rv[key * Dv + d] += prob * dout.get(b, h, m, d);
          for (int64_t d = 0; d < D; ++d) {
            rk[key * D + d] += double(scale_f) * ds * q.get(b, h, m, d);
            rq[row * D + d] += double(scale_f) * ds * k.get(b, h / group, n, d);
          }
        }
      }
  const double tol = sizeof(scalar_t) == 4 ? 1e-4 : (scalar_type<scalar_t>() == ScalarType::kFloat16 ? 3e-3 : 2e-2);
  const auto compare = [&](const char* what, const std::vector<scalar_t>& got, const std::vector<double>& want) {
    double magnitude = 0;
    for (double w : want) magnitude = std::max(magnitude, std::fabs(w));
    for (size_t i = 0; i < want.size(); ++i) {
      const double g = to_float(got[i]);
      const double bound = tol * (std::fabs(want[i]) + 0.1 * magnitude + 1e-6);
      // NaN exactly where the reference has it.
      const bool bad = std::isnan(want[i]) ? !std::isnan(g) : !(std::fabs(g - want[i]) <= bound);
      if (bad) fail(c, what, static_cast<int64_t>(i), g, want[i]);
    }
  };
  compare("grad_q", dq, rq);
  compare("grad_k", dk, rk);
  compare("grad_v", dv, rv);
  std::printf("  %-48s ok=%s\n", c.name, g_failures == 0 ? "yes" : "NO");
}

}  // namespace bwd_emulation
