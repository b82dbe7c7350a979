// Runs the CUDA cross-attention forward kernels' source on the host (cuda_emulation/) and compares
// them with a double-precision reference computed from the same rounded inputs: the SIMT kernel for
// fp32, the tensor-core (WMMA, through the emulator's <mma.h> shim) kernel for fp16/bf16 — the
// instantiation the launch plan picks for the dtype.
//
// The inputs are laid out to catch indexing bugs, not just arithmetic ones: permuted and padded
// strides, a broadcast (stride 0) batch, and NaN in every element the kernel must not read (the
// padding between rows and the rows past N), so a stray read shows up as NaN in the output. The
// output and lse are surrounded by guard words, and shared memory past the planned size is checked
// to be untouched. Masked cases also hold NaN in the padded keys' k and v rows (padded keys are
// never read) and a NaN query element, whose row alone must come out NaN, lse included.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "attention_fwd_kernel.cuh"
#include "attention_fwd_wmma_kernel.cuh"
#include "cuda_emulation/emulator_extras_tree.h"  // smem_raw
#include "cuda_emulation/scalar_types.h"

namespace {

using attn_ext::cuda::CrossAttentionFwdParams;
using attn_ext::cuda::CrossAttentionLaunchPlan;
using attn_ext::ScalarType;

int g_failures = 0;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

template <typename T> T from_float(float x);
template <> float from_float<float>(float x) { return x; }
template <> __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
float as_float(float x) { return x; }
float as_float(__half x) { return __half2float(x); }
float as_float(__nv_bfloat16 x) { return __bfloat162float(x); }

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
};

void fail(const Case& c, const char* what, int64_t index, double got, double want) {
  if (++g_failures <= 20) {
    std::fprintf(stderr, "[%s] %s at %lld: got %.9g want %.9g\n", c.name, what, static_cast<long long>(index),
                 got, want);
  }
}

/// sm_90's opt-in shared memory per block: plans keep their preferred tiles.
constexpr std::size_t kSm90 = 232448;
/// The compute capability the plans are given: one whose tensor cores take every dtype, so that the
/// emulator also runs the bf16 kernels with the fall-back tiles of smaller shared-memory limits.
constexpr int kEveryDtypeCapability = 90;

/// The preferred tile of an instantiation: warps per block (WMMA) or rows per warp (fp32).
template <typename scalar_t, int kDv>
constexpr int preferred_tile() {
  return sizeof(scalar_t) == 2 ? attn_ext::cuda::kCrossAttentionWmmaWarps
                               : attn_ext::cuda::cross_attention_fwd_rows_per_warp(kDv);
}

/// Runs one case with the (kD, kDv, kTile) instantiation, which must be the one the plan picks for a
/// device with `smem_limit` bytes of shared memory per block. kTile: warps per block (WMMA) or rows
/// per warp (fp32). kPair: the pair-mask instantiation (the case must have causal or attn_mask).
template <typename scalar_t, int kD, int kDv, int kTile = preferred_tile<scalar_t, kDv>(), bool kPair = false>
void run_case(const Case& c, uint32_t seed, std::size_t smem_limit = kSm90) {
  if (kPair != (c.causal || c.attn_mask != kNoAttnMask)) {
    fail(c, "kPair must be set exactly for causal / attn_mask cases", 0, 0, 0);
    return;
  }
  const int64_t B = c.B, H = c.H, M = c.M, N = c.N, D = c.D, Dv = c.Dv;
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto rnd = [&] { return from_float<scalar_t>(normal(gen)); };

  // q stored as [B, M, H, D + 3] (a transposed view with padded rows); k as [B or 1, H, N + 2, D + 1]
  // with two NaN rows past N; v as [B, H, N, Dv + 5]. Everything not part of the logical tensor is NaN.
  // k and v have Hkv = H / kv_group heads (GQA); query head h reads head h / kv_group.
  const int64_t Hkv = H / c.kv_group, group = c.kv_group;
  const int64_t qd = D + 3, kd = D + 1, vd = Dv + 5, kn = N + 2, kb = c.broadcast_k ? 1 : B;
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

  constexpr int64_t kGuard = 37;
  const float kSentinel = 12288.0f;  // exact in fp16 and bf16
  std::vector<scalar_t> out(B * H * M * Dv + 2 * kGuard, from_float<scalar_t>(kSentinel));
  std::vector<float> lse(B * H * M + 2 * kGuard, kSentinel);
  p.q = q.data(), p.k = k.data(), p.v = v.data();
  p.out = out.data() + kGuard, p.lse = lse.data() + kGuard;

  const CrossAttentionLaunchPlan plan = attn_ext::cuda::plan_cross_attention_fwd(
      B, H, M, N, D, Dv, p.dtype, smem_limit, kEveryDtypeCapability, p.has_pair_masks());
  constexpr bool kPairMasks = kPair;
  const int tile = sizeof(scalar_t) == 2 ? plan.warps : plan.rows_per_warp;
  if (!plan.supported || plan.head_dim_instantiation != kD || plan.head_dim_v_instantiation != kDv || tile != kTile) {
    fail(c, "plan does not select the tested instantiation", 0, tile, kTile);
    return;
  }
  if (plan.tensor_cores != (sizeof(scalar_t) == 2)) fail(c, "plan picks the wrong kernel family", 0, 0, 0);
  if (plan.shared_memory_bytes > smem_limit) fail(c, "plan exceeds the device limit", 0, 0, 0);
  auto* smem_bytes = reinterpret_cast<unsigned char*>(attn_ext::cuda::detail::smem_raw);
  const size_t smem_total = sizeof(attn_ext::cuda::detail::smem_raw);
  for (unsigned int bx = 0; bx < plan.grid.x; ++bx) {
    std::memset(smem_bytes, 0xff, smem_total);  // 0xffffffff is a NaN: uninitialised reads show up
    cuda_emu::run_block(dim3(plan.grid.x), dim3(bx), dim3(plan.block.x, plan.block.y, plan.block.z), [&] {
      if constexpr (sizeof(scalar_t) == 2) {
        static_assert(kD == kDv, "the tensor-core kernel has one head-dim instantiation");
        static_assert(attn_ext::cuda::cross_attention_wmma_warps_compiled(kD, kTile), "a compiled tile");
        attn_ext::cuda::detail::cross_attention_fwd_wmma_kernel<scalar_t, kD, kTile, kPairMasks>(p);
      } else {
        static_assert(attn_ext::cuda::cross_attention_fwd_rows_compiled(kD, kDv, kTile), "a compiled tile");
        static_assert(!kPairMasks || kD == kDv, "the pair-mask fp32 kernel has one head-dim bucket");
        attn_ext::cuda::detail::cross_attention_fwd_kernel<scalar_t, kD, kDv, kTile,
                                                           attn_ext::cuda::kCrossAttentionFwdWarps, kPairMasks>(p);
      }
    });
    for (size_t i = plan.shared_memory_bytes; i < smem_total; ++i) {
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
          s[n] = dot * double(p.scale) + additive(b, h, m, n);
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
  std::printf("  %-52s grid=%u block_m=%d smem=%zu/%zu B ok=%s\n", c.name, plan.grid.x, plan.block_m,
              plan.shared_memory_bytes, smem_limit, g_failures == 0 ? "yes" : "NO");
}

}  // namespace

int main() {
  uint32_t seed = 1;
  // name, B, H, M, N, D, Dv, mask, broadcast_k, score_scale
  run_case<float, 64, 64>({"fp32 D=40 Dv=59 masked, M/N tails", 2, 3, 37, 70, 40, 59, true, false, 1.0f}, seed++);
  run_case<float, 32, 32>({"fp32 D=Dv=1 broadcast k", 2, 1, 5, 33, 1, 1, false, true, 1.0f}, seed++);
  run_case<float, 32, 128>({"fp32 D=32 Dv=96 large scores", 1, 2, 40, 45, 32, 96, true, false, 30.0f}, seed++);
  run_case<float, 256, 32>({"fp32 D=256 Dv=32", 1, 1, 33, 40, 256, 32, false, false, 1.0f}, seed++);
  run_case<float, 64, 64>({"fp32 N=0 (no keys)", 2, 2, 9, 0, 64, 64, false, false, 1.0f}, seed++);
  run_case<__half, 64, 64>({"fp16 D=64 Dv=64 masked", 3, 2, 17, 64, 64, 64, true, false, 1.0f}, seed++);
  run_case<__half, 64, 64>({"fp16 D=40 Dv=59 masked, M/N tails", 2, 3, 37, 70, 40, 59, true, false, 1.0f}, seed++);
  run_case<__half, 64, 64>({"fp16 M=1 N=239 D=40", 2, 1, 1, 239, 40, 40, true, false, 1.0f}, seed++);
  run_case<__half, 128, 128>({"fp16 D=96 Dv=128", 1, 1, 50, 31, 96, 128, false, true, 1.0f}, seed++);
  run_case<__half, 32, 32>({"fp16 N=0 (no keys)", 2, 2, 9, 0, 7, 3, false, false, 1.0f}, seed++);
  run_case<__nv_bfloat16, 64, 64>({"bf16 M=113 N=203 D=59 large scores", 1, 1, 113, 203, 59, 59, true, false, 8.0f},
                                  seed++);
  run_case<__nv_bfloat16, 256, 256>({"bf16 D=128 Dv=200 masked", 2, 1, 20, 37, 128, 200, true, false, 1.0f}, seed++);
  run_case<__nv_bfloat16, 256, 256>({"bf16 D=Dv=256", 1, 1, 17, 33, 256, 256, false, false, 1.0f}, seed++);
  // The fall-back tiles of devices with less shared memory (common/smem_limits.h): 99 KiB (sm_86/89),
  // 64 KiB (sm_75). Each compiled fall-back runs once.
  constexpr std::size_t kSm86 = 101376, kSm75 = 65536;
  run_case<__half, 256, 256, 2>({"fp16 D=200 Dv=256 masked, 99 KiB: 2 warps", 2, 1, 37, 45, 200, 256, true, false, 1.0f},
                                seed++, kSm86);
  run_case<__nv_bfloat16, 256, 256, 1>({"bf16 D=Dv=256, 64 KiB: 1 warp", 1, 2, 21, 40, 256, 256, false, false, 1.0f},
                                       seed++, kSm75);
  run_case<__nv_bfloat16, 128, 128, 2>(
      {"bf16 D=96 Dv=128 masked, 64 KiB: 2 warps", 2, 1, 40, 50, 96, 128, true, false, 1.0f}, seed++, kSm75);
  run_case<float, 256, 32, 4>({"fp32 D=256 Dv=32, 64 KiB: 4 rows/warp", 1, 1, 33, 40, 256, 32, true, false, 1.0f}, seed++,
                              kSm75);
  run_case<float, 256, 64, 4>({"fp32 D=200 Dv=50, 64 KiB: 4 rows/warp", 2, 1, 19, 35, 200, 50, false, true, 1.0f}, seed++,
                              kSm75);
  run_case<float, 256, 128, 2>({"fp32 D=256 Dv=100 masked, 64 KiB: 2 rows/warp", 2, 1, 13, 37, 256, 100, true, false, 1.0f},
                               seed++, kSm75);
  // attention_fwd: causal (top-left, M ≠ N too), bool / additive attn_mask views with broadcast dims,
  // GQA, combined with key padding; NaN in a key masked for every row that could see it.
  // name, B, H, M, N, D, Dv, mask, broadcast_k, score_scale, causal, attn_mask, kv_group
  run_case<float, 64, 64, 8, true>({"fp32 causal M=N=70 D=40 Dv=59 padded", 2, 3, 70, 70, 40, 59, true, false, 1.0f, true},
                                   seed++);
  run_case<float, 64, 64, 8, true>(
      {"fp32 bool attn_mask, GQA 4/2", 2, 4, 37, 45, 40, 40, false, false, 1.0f, false, kBoolMask, 2}, seed++);
  run_case<float, 32, 32, 8, true>(
      {"fp32 additive + causal + padded, M=50 N=33", 2, 2, 50, 33, 32, 32, true, false, 1.0f, true, kAdditiveMask}, seed++);
  run_case<float, 32, 32, 8, true>({"fp32 causal M=20 N=90 (keys past M)", 1, 1, 20, 90, 16, 16, false, false, 4.0f, true},
                                   seed++);
  run_case<float, 256, 256, 4, true>({"fp32 causal D=200 Dv=30", 1, 1, 33, 40, 200, 30, false, false, 1.0f, true}, seed++);
  run_case<float, 32, 32>({"fp32 GQA 6/3, no pair mask", 1, 6, 20, 40, 32, 32, true, false, 1.0f, false, kNoAttnMask, 3},
                          seed++);
  run_case<__half, 64, 64, 4, true>(
      {"fp16 causal + bool + padded, GQA 4/2", 2, 4, 70, 70, 40, 59, true, false, 1.0f, true, kBoolMask, 2}, seed++);
  run_case<__half, 32, 32, 4, true>(
      {"fp16 additive attn_mask", 2, 2, 37, 50, 32, 16, false, false, 1.0f, false, kAdditiveMask}, seed++);
  run_case<__nv_bfloat16, 128, 128, 4, true>(
      {"bf16 additive + causal M=N=100, GQA 2/1", 1, 2, 100, 100, 96, 96, true, false, 1.0f, true, kAdditiveMask, 2},
      seed++);
  run_case<__nv_bfloat16, 128, 128, 2, true>(
      {"bf16 bool attn_mask, 64 KiB: 2 warps", 2, 1, 40, 50, 96, 128, false, false, 1.0f, false, kBoolMask}, seed++,
      kSm75);
  if (g_failures != 0) {
    std::fprintf(stderr, "attn_ext_cuda_emulation_tests: %d mismatch(es)\n", g_failures);
    return 1;
  }
  std::printf("attn_ext_cuda_emulation_tests: all cases passed\n");
  return 0;
}
