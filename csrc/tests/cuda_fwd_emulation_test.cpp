// Runs the CUDA cross-attention forward kernels' source on the host (cuda_emulation/) against a double
// reference (cuda_fwd_emulation_case.h): the SIMT kernel for fp32 and the tensor-core (WMMA, through
// the emulator's <mma.h> shim) kernel for fp16/bf16, the instantiation the launch plan picks for the
// dtype, at every fall-back tile of smaller shared memories.
#include "attention_fwd_kernel.cuh"
#include "attention_fwd_wmma_kernel.cuh"
#include "cuda_fwd_emulation_case.h"
#include "cuda_packed_emulation_case.h"

namespace {

using namespace fwd_emulation;
using attn_ext::cuda::CrossAttentionFwdParams;
using attn_ext::cuda::CrossAttentionLaunchPlan;

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
  if (kPair != (c.causal || c.attn_mask != kNoAttnMask || c.rules.any())) {
    fail(c, "kPair must be set exactly for causal / attn_mask cases", 0, 0, 0);
    return;
  }
  const auto planner = [&](const CrossAttentionFwdParams& p) {
    const CrossAttentionLaunchPlan plan = attn_ext::cuda::plan_cross_attention_fwd(
        p.B, p.H, p.M, p.N, p.D, p.Dv, p.dtype, smem_limit, kEveryDtypeCapability, p.has_pair_masks());
    const int tile = sizeof(scalar_t) == 2 ? plan.warps : plan.rows_per_warp;
    if (!plan.supported || plan.head_dim_instantiation != kD || plan.head_dim_v_instantiation != kDv || tile != kTile) {
      fail(c, "plan does not select the tested instantiation", 0, tile, kTile);
      return FwdLaunch{};
    }
    if (plan.tensor_cores != (sizeof(scalar_t) == 2)) fail(c, "plan picks the wrong kernel family", 0, 0, 0);
    return FwdLaunch{plan.grid.x, plan.block.x, plan.shared_memory_bytes, plan.block_m};
  };
  const auto kernel = [](const CrossAttentionFwdParams& p) {
    if constexpr (sizeof(scalar_t) == 2) {
      static_assert(kD == kDv, "the tensor-core kernel has one head-dim instantiation");
      static_assert(attn_ext::cuda::cross_attention_wmma_warps_compiled(kD, kTile), "a compiled tile");
      attn_ext::cuda::detail::cross_attention_fwd_wmma_kernel<scalar_t, kD, kTile, kPair>(p);
    } else {
      static_assert(attn_ext::cuda::cross_attention_fwd_rows_compiled(kD, kDv, kTile), "a compiled tile");
      static_assert(!kPair || kD == kDv, "the pair-mask fp32 kernel has one head-dim bucket");
      attn_ext::cuda::detail::cross_attention_fwd_kernel<scalar_t, kD, kDv, kTile,
                                                         attn_ext::cuda::kCrossAttentionFwdWarps, kPair>(p);
    }
  };
  run_forward_case<scalar_t>(c, seed, smem_limit, planner, kernel);
}


/// The packed cases (cuda_packed_emulation_case.h) with the (kD, kDv) instantiation, without and with pair masks.
template <typename scalar_t, int kD, int kDv>
void run_packed_cases(int64_t D, int64_t Dv, uint32_t seed) {
  constexpr int kTile = preferred_tile<scalar_t, kDv>();
  for (const packed_emulation::PackedCase& c : packed_emulation::packed_cases(D, Dv)) {
    const auto grid = [&](const CrossAttentionFwdParams& p, unsigned int* blocks, unsigned int* threads,
                          std::size_t* smem) {
      const CrossAttentionLaunchPlan plan = attn_ext::cuda::plan_cross_attention_fwd(
          p.B, p.H, p.M, p.N, p.D, p.Dv, p.dtype, kSm90, kEveryDtypeCapability, p.has_pair_masks());
      const int tile = sizeof(scalar_t) == 2 ? plan.warps : plan.rows_per_warp;
      if (!plan.supported || plan.head_dim_instantiation != kD || plan.head_dim_v_instantiation != kDv ||
          tile != kTile) {
        return packed_emulation::fail(c, "plan does not select the tested instantiation", 0, tile, kTile);
      }
      *blocks = plan.grid.x, *threads = plan.block.x, *smem = plan.shared_memory_bytes;
    };
    const auto kernel = [](const CrossAttentionFwdParams& p) {
      namespace det = attn_ext::cuda::detail;
      constexpr int kWarps = attn_ext::cuda::kCrossAttentionFwdWarps;
      if constexpr (sizeof(scalar_t) == 2) {
        p.has_pair_masks() ? det::cross_attention_fwd_wmma_kernel<scalar_t, kD, kTile, true>(p)
                           : det::cross_attention_fwd_wmma_kernel<scalar_t, kD, kTile, false>(p);
      } else {
        static_assert(kD == kDv, "the pair-mask fp32 kernel has one head-dim bucket");
        p.has_pair_masks() ? det::cross_attention_fwd_kernel<scalar_t, kD, kDv, kTile, kWarps, true>(p)
                           : det::cross_attention_fwd_kernel<scalar_t, kD, kDv, kTile, kWarps, false>(p);
      }
    };
    packed_emulation::run_packed_forward<scalar_t>(c, seed++, grid, kernel);
  }
}

/// `c` with score rules (a band, soft cap, ALiBi); kU: a side of the band without a limit.
Case ruled(Case c, emulation_rules::ScoreRules rules) {
  c.rules = rules;
  return c;
}
constexpr int64_t kU = emulation_rules::kBandUnbounded;

}  // namespace


int main() {
  uint32_t seed = 1;
  // name, B, H, M, N, D, Dv, mask, broadcast_k, score_scale
  run_case<float, 64, 64>({"fp32 D=40 Dv=59 masked, M/N tails", 2, 3, 37, 70, 40, 59, true, false, 1.0f}, seed++);
  run_case<float, 32, 32>({"fp32 D=Dv=1 broadcast k", 2, 1, 5, 33, 1, 1, false, true, 1.0f}, seed++);
  run_case<float, 32, 128>({"fp32 D=32 Dv=96 large scores", 2, 2, 40, 45, 32, 96, true, false, 30.0f}, seed++);
  run_case<float, 256, 32>({"fp32 D=256 Dv=32", 1, 1, 33, 40, 256, 32, false, false, 1.0f}, seed++);
  run_case<float, 64, 64>({"fp32 N=0 (no keys)", 2, 2, 9, 0, 64, 64, false, false, 1.0f}, seed++);
  run_case<__half, 64, 64>({"fp16 D=64 Dv=64 masked", 3, 2, 17, 64, 64, 64, true, false, 1.0f}, seed++);
  run_case<__half, 64, 64>({"fp16 D=40 Dv=59 masked, M/N tails", 2, 3, 37, 70, 40, 59, true, false, 1.0f}, seed++);
  run_case<__half, 64, 64>({"fp16 M=1 N=239 D=40", 2, 1, 1, 239, 40, 40, true, false, 1.0f}, seed++);
  run_case<__half, 128, 128>({"fp16 D=96 Dv=128", 1, 1, 50, 31, 96, 128, false, true, 1.0f}, seed++);
  run_case<__half, 32, 32>({"fp16 N=0 (no keys)", 2, 2, 9, 0, 7, 3, false, false, 1.0f}, seed++);
  run_case<__nv_bfloat16, 64, 64>({"bf16 M=113 N=203 D=59 large scores", 2, 1, 113, 203, 59, 59, true, false, 8.0f},
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
  run_case<float, 256, 32, 4>({"fp32 D=256 Dv=32, 64 KiB: 4 rows/warp", 2, 1, 33, 40, 256, 32, true, false, 1.0f}, seed++,
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
  run_case<float, 32, 32>({"fp32 GQA 6/3, no pair mask", 2, 6, 20, 40, 32, 32, true, false, 1.0f, false, kNoAttnMask, 3},
                          seed++);
  run_case<__half, 64, 64, 4, true>(
      {"fp16 causal + bool + padded, GQA 4/2", 2, 4, 70, 70, 40, 59, true, false, 1.0f, true, kBoolMask, 2}, seed++);
  run_case<__half, 32, 32, 4, true>(
      {"fp16 additive attn_mask", 2, 2, 37, 50, 32, 16, false, false, 1.0f, false, kAdditiveMask}, seed++);
  run_case<__nv_bfloat16, 128, 128, 4, true>(
      {"bf16 additive + causal M=N=100, GQA 2/1", 2, 2, 100, 100, 96, 96, true, false, 1.0f, true, kAdditiveMask, 2},
      seed++);
  run_case<__nv_bfloat16, 128, 128, 2, true>(
      {"bf16 bool attn_mask, 64 KiB: 2 warps", 2, 1, 40, 50, 96, 128, false, false, 1.0f, false, kBoolMask}, seed++,
      kSm75);
  // Score rules: a sliding window aligned bottom-right (tiles left of it skipped), a two-sided window with soft
  // cap and ALiBi on padded keys, a band leaving rows without keys (out 0, lse -inf), ALiBi over an additive mask.
  // ScoreRules: band_lo, band_hi, diagonal, softcap, alibi (head h's slope alibi·(h + 1)).
  run_case<float, 64, 64, 8, true>(
      ruled({"fp32 window (16, 0) bottom-right M=40 N=100", 2, 2, 40, 100, 40, 40, false, false, 1.0f}, {44, 60, 60}),
      seed++);
  run_case<float, 32, 32, 8, true>(
      ruled({"fp32 window (5, 7) + softcap + ALiBi, padded", 2, 2, 50, 70, 32, 32, true, false, 6.0f},
            {-5, 7, 0, 3.0f, 0.25f}),
      seed++);
  run_case<__half, 64, 64, 4, true>(
      ruled({"fp16 band (25, 25): rows without keys", 1, 2, 40, 30, 64, 64, false, false, 1.0f}, {25, 25, 0}), seed++);
  run_case<__nv_bfloat16, 128, 128, 4, true>(
      ruled({"bf16 ALiBi (diagonal 10) + softcap + additive, GQA 2/1", 2, 2, 60, 70, 96, 96, true, false, 4.0f, false,
             kAdditiveMask, 2},
            {-kU, kU, 10, 5.0f, 0.125f}),
      seed++);
  // Packed (varlen) batches: each block on its own sequence's rows, keys, band and slopes.
  run_packed_cases<float, 64, 64>(40, 59, seed), seed += 10;
  run_packed_cases<__half, 64, 64>(64, 48, seed), seed += 10;
  run_packed_cases<__nv_bfloat16, 128, 128>(96, 128, seed), seed += 10;
  g_failures += packed_emulation::g_failures;
  if (g_failures != 0) {
    std::fprintf(stderr, "attn_ext_cuda_emulation_tests: %d mismatch(es)\n", g_failures);
    return 1;
  }
  std::printf("attn_ext_cuda_emulation_tests: all cases passed\n");
  return 0;
}
