// Runs the CUDA cross-attention backward kernels' source on the host (cuda_emulation/) against a
// double-precision reference of docs/spec.md §1's backward computed from the same rounded inputs and the
// same saved (out, lse), and checks plan_cross_attention_bwd().
//
// Inputs are strided views with NaN in every element the kernels must not read (row padding, the
// rows past N); the last batch's keys are all padding when masked (its rows must get zero grads);
// grad_lse is nonzero. Shared memory past the planned size must stay untouched. Masked cases also
// hold NaN in the padded keys' k and v rows (never read: zero gradients there, no NaN elsewhere) and
// a NaN query element, whose row is NaN (out and lse) and passes NaN gradients to its head's keys.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "attention_bwd_kernel.cuh"
#include "attention_bwd_wmma_kernel.cuh"
#include "cuda_emulation/emulator_extras_tree.h"
#include "cuda_emulation/scalar_types.h"

namespace {

using attn_ext::cuda::CrossAttentionBwdParams;
using attn_ext::cuda::CrossAttentionBwdPlan;
using attn_ext::ScalarType;
using attn_ext::cuda::detail::from_float;
using attn_ext::cuda::detail::to_float;

int g_failures = 0;
constexpr double kInf = std::numeric_limits<double>::infinity();

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
};

void fail(const Case& c, const char* what, int64_t index, double got, double want) {
  if (++g_failures <= 20) {
    std::fprintf(stderr, "[%s] %s at %lld: got %.9g want %.9g\n", c.name, what, static_cast<long long>(index), got,
                 want);
  }
}

/// A [B, H, rows, cols] tensor stored with padded rows (stride cols + 3), NaN outside the logical view.
template <typename T>
struct Strided {
  int64_t H, rows, cols, stride_m, stride_h, stride_b;
  std::vector<T> data;
  Strided(int64_t B, int64_t H_, int64_t rows_, int64_t cols_)
      : H(H_), rows(rows_), cols(cols_), stride_m(cols_ + 3), stride_h((rows_ + 2) * (cols_ + 3)),
        stride_b(H_ * (rows_ + 2) * (cols_ + 3)),
        data(static_cast<size_t>(B * stride_b + 1), from_float<T>(std::numeric_limits<float>::quiet_NaN())) {}
  T& at(int64_t b, int64_t h, int64_t r, int64_t c) { return data[b * stride_b + h * stride_h + r * stride_m + c]; }
  double get(int64_t b, int64_t h, int64_t r, int64_t c) { return to_float(at(b, h, r, c)); }
};

/// sm_90's opt-in shared memory per block: plans keep their preferred tiles.
constexpr std::size_t kSm90 = 232448;
/// The compute capability the plans are given: one whose tensor cores take every dtype, so that the
/// emulator also runs the bf16 kernels with the fall-back tiles of smaller shared-memory limits.
constexpr int kEveryDtypeCapability = 90;

/// The preferred tile: 16-row tiles (fp32, kDim = 0) or the bucket's preferred warp count.
constexpr int preferred_tile(int dim) {
  return dim == 0 ? attn_ext::cuda::kCrossAttentionBwdTile : attn_ext::cuda::cross_attention_bwd_wmma_preferred_warps(dim);
}

/// kDim = 0: the SIMT kernels (fp32) with kTile-row tiles; else the tensor-core kernels of that
/// head-dim bucket (fp16/bf16) with kTile warps; the plan for `smem_limit` must pick them.
/// kPair: the pair-mask instantiations (the case must have causal or attn_mask).
template <typename scalar_t, int kDim = 0, int kTile = preferred_tile(kDim), bool kPair = false>
void run_case(const Case& c, uint32_t seed, std::size_t smem_limit = kSm90) {
  const int64_t B = c.B, H = c.H, M = c.M, N = c.N, D = c.D, Dv = c.Dv;
  const int64_t group = c.kv_group, Hkv = H / group;  // query head h reads key/value head h / group
  if (kPair != (c.causal || c.attn_mask != kNoAttnMask)) return fail(c, "kPair must match the case", 0, 0, 0);
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Strided<scalar_t> q(B, H, M, D), k(B, Hkv, N, D), v(B, Hkv, N, Dv), out(B, H, M, Dv), dout(B, H, M, Dv);
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
    return dot * double(scale_f) + additive(b, h, m, n);
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

  const CrossAttentionBwdPlan plan = attn_ext::cuda::plan_cross_attention_bwd(B, H, M, N, D, Dv, p.dtype, smem_limit,
                                                                              kEveryDtypeCapability, group);
  if (!plan.supported) return fail(c, "plan rejected the case", 0, 0, 0);
  if ((kDim > 0 ? plan.warps : plan.tile) != kTile) return fail(c, "plan picks another tile", 0, plan.warps, kTile);
  if (plan.dkdv_smem_bytes > smem_limit || plan.dq_smem_bytes > smem_limit) fail(c, "plan exceeds the limit", 0, 0, 0);
  void* smem = attn_ext::cuda::detail::smem_raw;
  const size_t smem_total = sizeof(attn_ext::cuda::detail::smem_raw);
  const auto dims = [](attn_ext::cuda::LaunchDims d) { return dim3(d.x, d.y, d.z); };
  namespace det = attn_ext::cuda::detail;
  if (plan.tensor_cores != (kDim > 0) || plan.dim != kDim) return fail(c, "plan picks another kernel", 0, plan.dim, kDim);
  bool ok = cuda_emu::run_grid(dims(plan.delta_grid), dims(plan.delta_block), smem, smem_total, 0,
                               [&] { det::cross_attention_bwd_delta_kernel<scalar_t>(p); });
  if constexpr (kDim > 0) {
    static_assert(attn_ext::cuda::cross_attention_bwd_wmma_warps_compiled(kDim, kTile), "a compiled tile");
    ok &= cuda_emu::run_grid(dims(plan.dkdv_grid), dims(plan.block), smem, smem_total, plan.dkdv_smem_bytes,
                             [&] { det::cross_attention_bwd_wmma_kernel<scalar_t, kDim, kTile, true, kPair>(p); });
    ok &= cuda_emu::run_grid(dims(plan.dq_grid), dims(plan.block), smem, smem_total, plan.dq_smem_bytes,
                             [&] { det::cross_attention_bwd_wmma_kernel<scalar_t, kDim, kTile, false, kPair>(p); });
  } else {
    ok &= cuda_emu::run_grid(dims(plan.dkdv_grid), dims(plan.block), smem, smem_total, plan.dkdv_smem_bytes,
                             [&] { det::cross_attention_bwd_dkdv_kernel<scalar_t, kTile, kPair>(p); });
    ok &= cuda_emu::run_grid(dims(plan.dq_grid), dims(plan.block), smem, smem_total, plan.dq_smem_bytes,
                             [&] { det::cross_attention_bwd_dq_kernel<scalar_t, kTile, kPair>(p); });
  }
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
          const double ds = prob * (dp - dd + grad_lse[row]);
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
  std::printf("  %-48s grids delta=%u dkdv=%u dq=%u smem=%zu/%zu of %zu B ok=%s\n", c.name, plan.delta_grid.x,
              plan.dkdv_grid.x, plan.dq_grid.x, plan.dkdv_smem_bytes, plan.dq_smem_bytes, smem_limit,
              g_failures == 0 ? "yes" : "NO");
}

void test_plan() {
  using namespace attn_ext::cuda;
  const auto expect = [](bool cond, const char* what) {
    if (!cond && ++g_failures <= 20) std::fprintf(stderr, "plan: %s\n", what);
  };
  const CrossAttentionBwdPlan p = plan_cross_attention_bwd(2, 3, 33, 17, 40, 59, ScalarType::kFloat32, kSm90, 90);
  expect(!p.tensor_cores, "fp32 runs the SIMT kernels");
  expect(p.supported && p.block.x == 128 && p.tile == 16, "supported, 128 threads, 16-row tiles");
  expect(p.delta_grid.x == (2 * 3 * 33 + 3) / 4, "one warp per row in the Δ pre-pass");
  expect(p.dkdv_grid.x == 2 * 3 * 2 && p.dq_grid.x == 2 * 3 * 3, "16-row tiles");
  expect(p.dkdv_smem_bytes == 4u * cross_attention_bwd_smem(40, 59, true, 16).floats, "dK/dV smem");
  expect(p.dq_smem_bytes < p.dkdv_smem_bytes, "dQ keeps one accumulator");
  expect(plan_cross_attention_bwd(1, 1, 8, 8, 256, 256, ScalarType::kFloat32, kSm90, 90).dkdv_smem_bytes <=
             163u * 1024u,
         "D = Dv = 256 fits sm_80's opt-in shared memory");
  const CrossAttentionBwdPlan small = plan_cross_attention_bwd(2, 3, 33, 17, 256, 256, ScalarType::kFloat32, 98304, 70);
  expect(small.supported && small.tile == 8 && small.dkdv_grid.x == 2 * 3 * 3 && small.dq_grid.x == 2 * 3 * 5,
         "D = Dv = 256 on 96 KiB: 8-row tiles");
  const CrossAttentionBwdPlan tc = plan_cross_attention_bwd(2, 3, 33, 17, 40, 59, ScalarType::kBFloat16, kSm90, 90);
  expect(tc.tensor_cores && tc.dim == 64 && tc.block.x == 128 && tc.delta_block.x == 128, "bf16: WMMA, bucket 64");
  expect(tc.dkdv_grid.x == 2 * 3 * 1 && tc.dq_grid.x == 2 * 3 * 1, "64-row own tiles");
  expect(tc.dkdv_smem_bytes == cross_attention_bwd_wmma_smem(64, 4, true).bytes, "WMMA dK/dV smem");
  const CrossAttentionBwdPlan wide = plan_cross_attention_bwd(1, 1, 40, 40, 256, 8, ScalarType::kFloat16, kSm90, 90);
  expect(wide.dim == 256 && wide.block.x == 64 && wide.dq_grid.x == 2, "bucket 256: 2 warps, 32-row own tiles");
  for (int dim : {32, 64, 128, 256}) {
    for (int warps : {1, 2, 4}) {
      const CrossAttentionBwdWmmaSmem key = cross_attention_bwd_wmma_smem(dim, warps, true);
      expect(key.acc % 32 == 0 && key.coef % 32 == 0 && key.scores % 32 == 0, "32-byte aligned wmma sections");
    }
    expect(cross_attention_bwd_wmma_smem(dim, cross_attention_bwd_wmma_preferred_warps(dim), true).bytes <= 163u * 1024u,
           "WMMA backward fits sm_80");
  }
  const CrossAttentionBwdPlan no_keys = plan_cross_attention_bwd(1, 2, 8, 0, 64, 64, ScalarType::kFloat32, kSm90, 90);
  expect(no_keys.supported && no_keys.dkdv_grid.x == 0 && no_keys.dq_grid.x == 2, "N = 0 still writes dQ");
  expect(!plan_cross_attention_bwd(1, 1, 8, 8, 257, 64, ScalarType::kFloat32, kSm90, 90).supported, "D > 256 rejected");
  expect(!plan_cross_attention_bwd(1, 1, 8, 8, 64, 0, ScalarType::kFloat32, kSm90, 90).supported, "Dv = 0 rejected");
  expect(!plan_cross_attention_bwd(1, 1, 8, 8, 64, 64, static_cast<ScalarType>(9), kSm90, 90).supported,
         "bad dtype rejected");
  expect(!plan_cross_attention_bwd(1 << 20, 1 << 20, 1 << 20, 8, 64, 64, ScalarType::kFloat32, kSm90, 90).supported,
         "grid overflow rejected");
}

}  // namespace

int main() {
  test_plan();
  uint32_t seed = 11;
  // name, B, H, M, N, D, Dv, mask (last batch fully padded)
  run_case<float>({"fp32 M=1 N=239 D=40 masked", 2, 1, 1, 239, 40, 40, true}, seed++);
  run_case<float>({"fp32 M=113 N=203 D=59", 1, 1, 113, 203, 59, 59, false}, seed++);
  run_case<float>({"fp32 D=40 Dv=59 masked, 2 heads", 2, 2, 21, 35, 40, 59, true}, seed++);
  run_case<float>({"fp32 N=0", 1, 2, 9, 0, 8, 5, false}, seed++);
  run_case<float>({"fp32 M=0", 1, 2, 0, 9, 8, 5, false}, seed++);
  run_case<__half, 64>({"fp16 D=64 Dv=32 masked", 2, 2, 37, 70, 64, 32, true}, seed++);
  run_case<__half, 64>({"fp16 M=1 N=239 D=40 masked", 2, 1, 1, 239, 40, 40, true}, seed++);
  run_case<__half, 64>({"fp16 M=113 N=203 D=59", 1, 1, 113, 203, 59, 59, false}, seed++);
  run_case<__half, 32>({"fp16 N=0", 1, 2, 9, 0, 8, 5, false}, seed++);
  run_case<__half, 32>({"fp16 M=0", 1, 2, 0, 9, 8, 5, false}, seed++);
  run_case<__nv_bfloat16, 128>({"bf16 D=96 Dv=128 masked", 2, 1, 40, 70, 96, 128, true}, seed++);
  run_case<__nv_bfloat16, 256>({"bf16 D=Dv=256 masked", 2, 1, 17, 33, 256, 256, true}, seed++);
  // The fall-back tiles of devices with less shared memory (common/smem_limits.h): 96 KiB (sm_70),
  // 99 KiB (sm_86/89), 64 KiB (sm_75). Each compiled fall-back runs once.
  constexpr std::size_t kSm70 = 98304, kSm86 = 101376, kSm75 = 65536;
  run_case<float, 0, 8>({"fp32 D=Dv=256 masked, 96 KiB: 8-row tiles", 2, 1, 19, 21, 256, 256, true}, seed++, kSm70);
  run_case<float, 0, 8>({"fp32 D=200 Dv=150, 64 KiB: 8-row tiles", 1, 2, 17, 9, 200, 150, false}, seed++, kSm75);
  run_case<__half, 64, 2>({"fp16 D=64 Dv=40 masked, 64 KiB: 2 warps", 2, 1, 37, 45, 64, 40, true}, seed++, kSm75);
  run_case<__nv_bfloat16, 128, 2>({"bf16 D=96 Dv=128 masked, 99 KiB: 2 warps", 2, 1, 40, 70, 96, 128, true}, seed++,
                                  kSm86);
  run_case<__half, 128, 1>({"fp16 D=Dv=128, 64 KiB: 1 warp", 1, 2, 20, 35, 128, 128, false}, seed++, kSm75);
  run_case<__half, 256, 1>({"fp16 D=256 Dv=200 masked, 96 KiB: 1 warp", 2, 1, 17, 33, 256, 200, true}, seed++, kSm70);
  // attention_bwd: causal (M ≠ N too), bool / additive attn_mask views, GQA (dK/dV summed over the
  // group), with key padding; NaN in a key and a query row masked for every pair that reads them.
  // name, B, H, M, N, D, Dv, mask, causal, attn_mask, kv_group
  run_case<float, 0, 16, true>({"fp32 causal M=N=45 padded", 2, 2, 45, 45, 40, 24, true, true}, seed++);
  run_case<float, 0, 16, true>({"fp32 bool attn_mask, GQA 4/2", 2, 4, 37, 29, 24, 40, false, false, kBoolMask, 2},
                               seed++);
  run_case<float, 0, 16, true>(
      {"fp32 additive + causal, M=40 N=23", 1, 2, 40, 23, 16, 16, true, true, kAdditiveMask}, seed++);
  run_case<float, 0, 16, true>({"fp32 causal M=10 N=50 (keys past M)", 1, 1, 10, 50, 8, 8, false, true}, seed++);
  run_case<float>({"fp32 GQA 6/3, no pair mask", 1, 6, 20, 33, 16, 16, true, false, kNoAttnMask, 3}, seed++);
  run_case<__half, 64, 4, true>(
      {"fp16 causal + bool + padded, GQA 4/2", 2, 4, 70, 70, 40, 59, true, true, kBoolMask, 2}, seed++);
  run_case<__half, 32, 4, true>({"fp16 additive attn_mask", 2, 2, 37, 50, 32, 16, false, false, kAdditiveMask}, seed++);
  run_case<__nv_bfloat16, 128, 4, true>(
      {"bf16 additive + causal M=N=100, GQA 2/1", 1, 2, 100, 100, 96, 96, true, true, kAdditiveMask, 2}, seed++);
  run_case<__nv_bfloat16, 64, 4>({"bf16 GQA 3/1, no pair mask", 1, 3, 33, 40, 64, 64, true, false, kNoAttnMask, 3},
                                  seed++);
  run_case<__half, 128, 1, true>({"fp16 bool causal, 64 KiB: 1 warp", 1, 2, 40, 35, 128, 128, false, true, kBoolMask},
                                 seed++, kSm75);
  if (g_failures != 0) {
    std::fprintf(stderr, "attn_ext_cuda_attention_bwd_emulation_tests: %d failure(s)\n", g_failures);
    return 1;
  }
  std::printf("attn_ext_cuda_attention_bwd_emulation_tests: all cases passed\n");
  return 0;
}
