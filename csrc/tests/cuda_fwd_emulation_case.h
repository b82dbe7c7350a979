// The forward emulation tests' common part: a case's inputs (laid out to catch indexing bugs), the
// emulated launch of a kernel over its grid, and the double-precision reference check. Used by
// cuda_fwd_emulation_test.cpp (SIMT and WMMA kernels) and cuda_fwd_mma_emulation_test.cpp (the
// mma.sync kernel).
//
// The inputs: permuted and padded strides, a broadcast (stride 0) batch, and NaN in every element the
// kernel must not read (the padding between rows and the rows past N), so a stray read shows up as NaN
// in the output. The output and lse are surrounded by guard words, and shared memory past the planned
// size is checked to be untouched. Masked cases also hold NaN in the padded keys' k and v rows (padded
// keys are never read) and a NaN query element, whose row alone must come out NaN, lse included.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "attention_fwd.cuh"
#include "cuda_emulation/emulator_extras_tree.h"  // smem_raw
#include "cuda_emulation/scalar_types.h"
#include "cuda_score_rules_case.h"

namespace fwd_emulation {

using attn_ext::cuda::CrossAttentionFwdParams;
using attn_ext::cuda::CrossAttentionLaunchPlan;
using attn_ext::ScalarType;

inline int g_failures = 0;
inline constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

template <typename T> T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
inline float as_float(float x) { return x; }
inline float as_float(__half x) { return __half2float(x); }
inline float as_float(__nv_bfloat16 x) { return __bfloat162float(x); }

using cuda_emu::scalar_type;

/// attn_mask of a case: none, bool (True = take part) or additive in the inputs' dtype.
enum AttnMask { kNoAttnMask, kBoolMask, kAdditiveMask };

struct Case {
  const char* name;
  int64_t B, H, M, N, D, Dv;
  bool mask;          // random padding, and the last batch fully padded
  bool broadcast_k;   // k's batch stride 0
  float score_scale;  // multiplies the default 1/sqrt(D), large values stress the running max
  // attention_fwd's additions (the pair-mask instantiations run when causal or attn_mask is set).
  bool causal = false;
  AttnMask attn_mask = kNoAttnMask;
  int64_t kv_group = 1;  // query heads per key/value head
  // Rows padded by multiples of 8 elements (16 bytes), as the mma kernel's cp.async loads need; the
  // other kernels' cases pad by odd amounts to catch any assumption of alignment.
  bool aligned = false;
  emulation_rules::ScoreRules rules{};  // a band, soft cap, ALiBi (pair-mask instantiations too)
};

/// The geometry a planner gives a case: grid, threads and shared memory of one block (grid 0: the
/// planner refused the case and said why through fail()).
struct FwdLaunch {
  unsigned int grid = 0, block = 0;
  std::size_t smem_bytes = 0;
  int block_m = 0;
};

inline void fail(const Case& c, const char* what, int64_t index, double got, double want) {
  if (++g_failures <= 20) {
    std::fprintf(stderr, "[%s] %s at %lld: got %.9g want %.9g\n", c.name, what, static_cast<long long>(index),
                 got, want);
  }
}

/// sm_90's opt-in shared memory per block: plans keep their preferred tiles.
inline constexpr std::size_t kSm90 = 232448;
/// The compute capability the plans are given: one whose tensor cores take every dtype, so that the
/// emulator also runs the bf16 kernels with the fall-back tiles of smaller shared-memory limits.
constexpr int kEveryDtypeCapability = 90;

/// Builds one case's inputs (see the file comment), asks `planner(p)` for the launch, runs
/// `kernel(p)` as every block of its grid under the emulator, and checks out and lse against a double
/// reference computed from the same rounded inputs.
template <typename scalar_t, typename Planner, typename Kernel>
void run_forward_case(const Case& c, uint32_t seed, std::size_t smem_limit, Planner planner, Kernel kernel) {
  const int64_t B = c.B, H = c.H, M = c.M, N = c.N, D = c.D, Dv = c.Dv;
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto rnd = [&] { return from_float<scalar_t>(normal(gen)); };

  // q stored as [B, M, H, D + 3] (a transposed view with padded rows); k as [B or 1, H, N + 2, D + 1]
  // with two NaN rows past N; v as [B, H, N, Dv + 5]. Everything not part of the logical tensor is NaN.
  // k and v have Hkv = H / kv_group heads (GQA); query head h reads head h / kv_group.
  const int64_t Hkv = H / c.kv_group, group = c.kv_group;
  const int64_t qd = c.aligned ? D + 8 : D + 3, kd = c.aligned ? D + 16 : D + 1, vd = c.aligned ? Dv + 8 : Dv + 5;
  const int64_t kn = N + 2, kb = c.broadcast_k ? 1 : B;
  std::vector<scalar_t> q(B * M * H * qd, from_float<scalar_t>(kNaN));
  std::vector<scalar_t> k(kb * Hkv * kn * kd + 1, from_float<scalar_t>(kNaN));
  std::vector<scalar_t> v(B * Hkv * N * vd + 1, from_float<scalar_t>(kNaN));
  CrossAttentionFwdParams p;
  p.B = B, p.H = H, p.M = M, p.N = N, p.D = D, p.Dv = Dv;
  p.q_stride_b = M * H * qd, p.q_stride_h = qd, p.q_stride_m = H * qd;
  p.k_stride_b = c.broadcast_k ? 0 : Hkv * kn * kd, p.k_stride_h = kn * kd, p.k_stride_n = kd;
  p.v_stride_b = Hkv * N * vd, p.v_stride_h = N * vd, p.v_stride_n = vd;
  p.kv_group = group, p.causal = c.causal;
  const auto qi = [&](int64_t b, int64_t h, int64_t m, int64_t d) {
    return b * p.q_stride_b + h * p.q_stride_h + m * p.q_stride_m + d;
  };
  const auto ki = [&](int64_t b, int64_t h, int64_t n, int64_t d) {
    return b * p.k_stride_b + h * p.k_stride_h + n * p.k_stride_n + d;
  };
  const auto vi = [&](int64_t b, int64_t h, int64_t n, int64_t d) {
    return b * p.v_stride_b + h * p.v_stride_h + n * p.v_stride_n + d;
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t d = 0; d < D; ++d) q[qi(b, h, m, d)] = rnd();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t n = 0; n < N; ++n) {
        for (int64_t d = 0; d < D; ++d) k[ki(b, h, n, d)] = rnd();  // rewritten per b when broadcast
        for (int64_t d = 0; d < Dv; ++d) v[vi(b, h, n, d)] = rnd();
      }
  std::vector<uint8_t> mask;
  if (c.mask) {
    p.mask_stride_b = N + 7;
    mask.assign(B * p.mask_stride_b, 1);
    std::bernoulli_distribution padded(0.3);
    for (int64_t b = 0; b + 1 < B; ++b)
      for (int64_t n = 0; n < N; ++n) mask[b * p.mask_stride_b + n] = padded(gen) ? 1 : 0;
    p.key_padding_mask = mask.data();
    // The NaN rule (docs/cross_attention.md): garbage in padded keys is never read; a NaN query
    // element makes its row NaN and nothing else. (k is per batch here: the masked cases do not
    // broadcast it.)
    for (int64_t b = 0; b < B && !c.broadcast_k; ++b)
      for (int64_t n = 0; n < N; ++n) {
        if (mask[b * p.mask_stride_b + n] == 0) continue;
        for (int64_t h = 0; h < Hkv; ++h) {
          for (int64_t d = 0; d < D; ++d) k[ki(b, h, n, d)] = from_float<scalar_t>(kNaN);
          for (int64_t d = 0; d < Dv; ++d) v[vi(b, h, n, d)] = from_float<scalar_t>(kNaN);
        }
      }
    if (M > 0) q[qi(0, 0, M - 1, 0)] = from_float<scalar_t>(kNaN);
  }
  // attn_mask as a strided view that is never copied: bool [1 → B, H, M, N] stored transposed
  // ([H][N][M + 1], batch broadcast), additive [B, 1 → H, M, N + 2] (head broadcast). Each masks
  // ~30% of the pairs at random, all of query row 1 (an empty row, unless it is the NaN row) and,
  // for batch 0's first key/value head, all of key N / 2 — whose k and v rows then hold NaN, which
  // must not reach any output (the tile takes the exact P·V path).
  std::vector<uint8_t> bool_mask;
  std::vector<scalar_t> add_mask;
  const int64_t nan_key = c.attn_mask != kNoAttnMask && N > 0 && !c.broadcast_k ? N / 2 : -1;
  if (c.attn_mask != kNoAttnMask) {
    std::bernoulli_distribution dropped(0.3);
    const bool is_bool = c.attn_mask == kBoolMask;
    if (is_bool) {
      p.attn_mask_stride_b = 0, p.attn_mask_stride_h = N * (M + 1), p.attn_mask_stride_m = 1, p.attn_mask_stride_n = M + 1;
      bool_mask.assign(H * N * (M + 1) + 1, 7);  // nonzero padding bytes: a stray read would unmask
    } else {
      p.attn_mask_stride_b = M * (N + 2), p.attn_mask_stride_h = 0, p.attn_mask_stride_m = N + 2, p.attn_mask_stride_n = 1;
      add_mask.assign(B * M * (N + 2) + 1, from_float<scalar_t>(kNaN));
    }
    for (int64_t b = 0; b < (is_bool ? 1 : B); ++b)
      for (int64_t h = 0; h < (is_bool ? H : 1); ++h)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < N; ++n) {
            const bool off = dropped(gen) || m == 1 || (n == nan_key && (is_bool ? h < group : true));
            const int64_t at = b * p.attn_mask_stride_b + h * p.attn_mask_stride_h + m * p.attn_mask_stride_m +
                               n * p.attn_mask_stride_n;
            if (is_bool) {
              bool_mask[at] = off ? 0 : 1;
            } else {
              add_mask[at] = from_float<scalar_t>(off ? -std::numeric_limits<float>::infinity() : 0.5f * normal(gen));
            }
          }
    p.attn_mask = is_bool ? static_cast<const void*>(bool_mask.data()) : static_cast<const void*>(add_mask.data());
    p.attn_mask_kind = is_bool ? attn_ext::cuda::AttnMaskKind::kBool : attn_ext::cuda::AttnMaskKind::kAdditive;
    if (nan_key >= 0) {
      for (int64_t d = 0; d < D; ++d) k[ki(0, 0, nan_key, d)] = from_float<scalar_t>(kNaN);
      for (int64_t d = 0; d < Dv; ++d) v[vi(0, 0, nan_key, d)] = from_float<scalar_t>(kNaN);
    }
  }
  // Whether pair (b, h, m, n) takes part, and its additive term.
  const auto allowed = [&](int64_t b, int64_t h, int64_t m, int64_t n) {
    if (c.mask && mask[b * p.mask_stride_b + n] != 0) return false;
    if (c.causal && n > m) return false;
    if (!c.rules.in_band(m, n)) return false;
    const int64_t at = b * p.attn_mask_stride_b + h * p.attn_mask_stride_h + m * p.attn_mask_stride_m +
                       n * p.attn_mask_stride_n;
    if (c.attn_mask == kBoolMask) return bool_mask[at] != 0;
    if (c.attn_mask == kAdditiveMask) return !std::isinf(as_float(add_mask[at]));
    return true;
  };
  const auto additive = [&](int64_t b, int64_t h, int64_t m, int64_t n) {
    if (c.attn_mask != kAdditiveMask) return 0.0;
    return double(as_float(add_mask[b * p.attn_mask_stride_b + h * p.attn_mask_stride_h + m * p.attn_mask_stride_m +
                                     n * p.attn_mask_stride_n]));
  };
  p.scale = c.score_scale / std::sqrt(static_cast<float>(D));
  p.dtype = scalar_type<scalar_t>();
  std::vector<float> slopes;
  c.rules.apply(p, H, slopes);

  constexpr int64_t kGuard = 37;
  const float kSentinel = 12288.0f;  // exact in fp16 and bf16
  std::vector<scalar_t> out(B * H * M * Dv + 2 * kGuard, from_float<scalar_t>(kSentinel));
  std::vector<float> lse(B * H * M + 2 * kGuard, kSentinel);
  p.q = q.data(), p.k = k.data(), p.v = v.data();
  p.out = out.data() + kGuard, p.lse = lse.data() + kGuard;

  const FwdLaunch plan = planner(p);
  if (plan.grid == 0 && B * H * M > 0) return;
  if (plan.smem_bytes > smem_limit) fail(c, "plan exceeds the device limit", 0, 0, 0);
  auto* smem_bytes = reinterpret_cast<unsigned char*>(attn_ext::cuda::detail::smem_raw);
  const size_t smem_total = sizeof(attn_ext::cuda::detail::smem_raw);
  for (unsigned int bx = 0; bx < plan.grid; ++bx) {
    std::memset(smem_bytes, 0xff, smem_total);  // 0xffffffff is a NaN: uninitialised reads show up
    cuda_emu::run_block(dim3(plan.grid), dim3(bx), dim3(plan.block), [&] { kernel(p); });
    for (size_t i = plan.smem_bytes; i < smem_total; ++i) {
      if (smem_bytes[i] != 0xff) {
        fail(c, "shared memory written past the planned size", static_cast<int64_t>(i), 0, 0);
        break;
      }
    }
  }

  // Reference in double from the stored (rounded) inputs.
  const double tol = sizeof(scalar_t) == 4 ? 2e-5 : (scalar_type<scalar_t>() == ScalarType::kFloat16 ? 2e-3 : 1e-2);
  for (int64_t i = 0; i < kGuard; ++i) {
    if (as_float(out[i]) != kSentinel || as_float(out[out.size() - 1 - i]) != kSentinel) fail(c, "out guard", i, 0, 0);
    if (lse[i] != kSentinel || lse[lse.size() - 1 - i] != kSentinel) fail(c, "lse guard", i, 0, 0);
  }
  std::vector<double> s(N), o(Dv);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t m = 0; m < M; ++m) {
        double mx = -std::numeric_limits<double>::infinity();
        const int64_t hk = h / group;
        for (int64_t n = 0; n < N; ++n) {
          s[n] = -std::numeric_limits<double>::infinity();
          if (!allowed(b, h, m, n)) continue;  // masked pairs are never read
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += double(as_float(q[qi(b, h, m, d)])) * as_float(k[ki(b, hk, n, d)]);
          // The kernel pre-scales q in fp32; mirror that rounding so the check stays tight.
          s[n] = c.rules.score(dot * double(p.scale), additive(b, h, m, n), h, m, n);
          mx = std::isnan(s[n]) || std::isnan(mx) ? s[n] + mx : std::max(mx, s[n]);  // NaN-propagating max
        }
        double want_lse = -std::numeric_limits<double>::infinity();
        std::fill(o.begin(), o.end(), 0.0);
        if (mx != -std::numeric_limits<double>::infinity()) {
          double sum = 0;
          for (int64_t n = 0; n < N; ++n) sum += std::exp(s[n] - mx);
          want_lse = mx + std::log(sum);
          for (int64_t n = 0; n < N; ++n) {
            if (!allowed(b, h, m, n)) continue;  // masked (or padded): never read
            const double w = std::exp(s[n] - want_lse);
            for (int64_t d = 0; d < Dv; ++d) o[d] += w * as_float(v[vi(b, hk, n, d)]);
          }
        }
        const int64_t row = (b * H + h) * M + m;
        const double got_lse = p.lse[row];
        // NaN expected: NaN required; otherwise a NaN fails the comparison below.
        const auto differs = [](double got, double want, double tol) {
          if (std::isnan(want)) return !std::isnan(got);
          if (std::isinf(want)) return got != want;
          return !(std::fabs(got - want) <= tol * (1 + std::fabs(want)));
        };
        if (differs(got_lse, want_lse, 1e-4)) fail(c, "lse", row, got_lse, want_lse);
        for (int64_t d = 0; d < Dv; ++d) {
          const double got = as_float(static_cast<const scalar_t*>(p.out)[row * Dv + d]);
          if (differs(got, o[d], tol)) fail(c, "out", row * Dv + d, got, o[d]);
        }
      }
  std::printf("  %-52s grid=%u block_m=%d smem=%zu/%zu B ok=%s\n", c.name, plan.grid, plan.block_m, plan.smem_bytes,
              smem_limit, g_failures == 0 ? "yes" : "NO");
}

}  // namespace fwd_emulation
