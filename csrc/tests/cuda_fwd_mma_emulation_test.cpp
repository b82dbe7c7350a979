// Runs the FlashAttention-2-style forward kernel's source (attention_fwd_mma_kernel.cuh) on the host, with
// the emulator's mma.sync / ldmatrix / cp.async (cuda_emulation/mma_sm80_emulation.h: PTX's fragment
// layouts, cp.async copies landing only at the wait), against the double reference of
// cuda_fwd_emulation_case.h. Every head-dim bucket, fp16 and bf16, row and key tails, padded keys with
// NaN behind them, a NaN query row, the causal rule (M = N, M < N, M > N: the diagonal tiles and the
// reversed row-tile order), bool and additive attn_mask views with a NaN key masked for every row that
// could see it (the exact P·V path), GQA, and no keys at all. Inputs are laid out on 16-byte row
// boundaries (the kernel's requirement, mma_fwd_ineligible()); the planner checks that they are.
#include "attention_fwd_mma_kernel.cuh"
#include "attention_fwd_mma_plan.h"
#include "cuda_fwd_emulation_case.h"
#include "cuda_packed_emulation_case.h"

namespace {

using namespace fwd_emulation;
using attn_ext::cuda::CrossAttentionFwdParams;

/// Runs one case with the kDim bucket's instantiation (the one the launcher takes for D and Dv).
template <typename scalar_t, int kDim>
void run_case(Case c, uint32_t seed) {
  c.aligned = true;
  const bool pair = c.causal || c.attn_mask != kNoAttnMask || c.rules.any();
  const auto planner = [&](const CrossAttentionFwdParams& p) {
    const char* why = attn_ext::cuda::mma_qkv_ineligible(80, p.D, p.Dv, p.q, p.k, p.v, p);
    const int dim = attn_ext::cuda::cross_attention_fwd_head_dim_instantiation(p.D > p.Dv ? p.D : p.Dv);
    if (why != nullptr || dim != kDim) {
      fail(c, why != nullptr ? why : "the case's head dims are not the tested bucket", 0, dim, kDim);
      return FwdLaunch{};
    }
    using L = attn_ext::cuda::detail::MmaFwdLayout<kDim>;
    const int64_t m_tiles = (p.M + L::kBlockM - 1) / L::kBlockM;
    return FwdLaunch{static_cast<unsigned int>(p.B * p.H * m_tiles), static_cast<unsigned int>(L::kThreads),
                     attn_ext::cuda::mma_fwd_smem_bytes(kDim), L::kBlockM};
  };
  const auto kernel = [pair](const CrossAttentionFwdParams& p) {
    if (pair) {
      attn_ext::cuda::detail::attention_fwd_mma_kernel<scalar_t, kDim, true>(p);
    } else {
      attn_ext::cuda::detail::attention_fwd_mma_kernel<scalar_t, kDim, false>(p);
    }
  };
  run_forward_case<scalar_t>(c, seed, kSm90, planner, kernel);
}


/// The packed cases (cuda_packed_emulation_case.h) with the kDim bucket's instantiation, rows 16-byte aligned.
template <typename scalar_t, int kDim>
void run_packed_cases(int64_t D, int64_t Dv, uint32_t seed) {
  for (packed_emulation::PackedCase c : packed_emulation::packed_cases(D, Dv)) {
    c.aligned = true;
    const auto grid = [&](const CrossAttentionFwdParams& p, unsigned int* blocks, unsigned int* threads,
                          std::size_t* smem) {
      const char* why = attn_ext::cuda::mma_qkv_ineligible(80, p.D, p.Dv, p.q, p.k, p.v, p);
      if (why != nullptr) return packed_emulation::fail(c, why, 0, 0, 0);
      using L = attn_ext::cuda::detail::MmaFwdLayout<kDim>;
      *blocks = static_cast<unsigned int>(p.B * p.H * ((p.M + L::kBlockM - 1) / L::kBlockM));
      *threads = L::kThreads, *smem = attn_ext::cuda::mma_fwd_smem_bytes(kDim);
    };
    const auto kernel = [](const CrossAttentionFwdParams& p) {
      p.has_pair_masks() ? attn_ext::cuda::detail::attention_fwd_mma_kernel<scalar_t, kDim, true>(p)
                         : attn_ext::cuda::detail::attention_fwd_mma_kernel<scalar_t, kDim, false>(p);
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
  uint32_t seed = 101;
  // name, B, H, M, N, D, Dv, mask, broadcast_k, score_scale[, causal, attn_mask, kv_group]
  run_case<__half, 64>({"mma fp16 D=64 masked, M/N tails", 2, 3, 37, 70, 64, 64, true, false, 1.0f}, seed++);
  run_case<__half, 64>({"mma fp16 D=40 Dv=24 (columns past D)", 2, 2, 20, 45, 40, 24, true, false, 1.0f}, seed++);
  run_case<__nv_bfloat16, 128>(
      {"mma bf16 D=128 M=130 N=203 large scores", 2, 1, 130, 203, 128, 128, true, false, 8.0f}, seed++);
  run_case<__half, 128>({"mma fp16 D=96 Dv=128 broadcast k", 2, 1, 50, 31, 96, 128, false, true, 1.0f}, seed++);
  run_case<__half, 32>({"mma fp16 D=32 M=1 N=239", 2, 1, 1, 239, 32, 32, true, false, 1.0f}, seed++);
  run_case<__half, 32>({"mma fp16 N=0 (no keys)", 2, 2, 9, 0, 16, 8, false, false, 1.0f}, seed++);
  run_case<__nv_bfloat16, 256>({"mma bf16 D=Dv=256", 1, 1, 17, 40, 256, 256, false, false, 1.0f}, seed++);
  run_case<__nv_bfloat16, 256>({"mma bf16 D=128 Dv=200 masked", 2, 1, 20, 37, 128, 200, true, false, 1.0f}, seed++);
  run_case<__half, 64>({"mma fp16 causal M=N=150 padded, GQA 4/2", 2, 4, 150, 150, 64, 64, true, false, 1.0f, true,
                        kNoAttnMask, 2},
                       seed++);
  run_case<__nv_bfloat16, 64>(
      {"mma bf16 causal M=20 N=90 (keys past M)", 1, 1, 20, 90, 48, 48, false, false, 4.0f, true}, seed++);
  run_case<__half, 32>({"mma fp16 causal M=90 N=20", 1, 1, 90, 20, 32, 32, false, false, 1.0f, true}, seed++);
  run_case<__nv_bfloat16, 128>({"mma bf16 additive + causal M=N=100, GQA 2/1", 2, 2, 100, 100, 96, 96, true, false,
                                1.0f, true, kAdditiveMask, 2},
                               seed++);
  run_case<__half, 64>(
      {"mma fp16 bool attn_mask, GQA 4/2", 2, 4, 37, 50, 40, 40, false, false, 1.0f, false, kBoolMask, 2}, seed++);
  // Score rules (ScoreRules: band_lo, band_hi, diagonal, softcap, alibi with head h's slope alibi·(h + 1)): a
  // bottom-right window over long keys (the first tiles skipped), a two-sided window with soft cap and ALiBi on
  // padded keys, a band leaving rows without keys, ALiBi over an additive mask with GQA.
  run_case<__half, 64>(
      ruled({"mma fp16 window (20, 0) bottom-right M=70 N=300", 1, 2, 70, 300, 64, 64, false, false, 1.0f},
            {210, 230, 230}),
      seed++);
  run_case<__nv_bfloat16, 128>(
      ruled({"mma bf16 window (30, 9) + softcap + ALiBi, padded", 2, 2, 130, 150, 128, 128, true, false, 8.0f},
            {-30, 9, 0, 4.0f, 0.25f}),
      seed++);
  run_case<__half, 32>(
      ruled({"mma fp16 band (25, 25): rows without keys", 1, 1, 40, 30, 32, 32, false, false, 1.0f}, {25, 25, 0}),
      seed++);
  run_case<__half, 64>(
      ruled({"mma fp16 ALiBi (diagonal -7) + additive, GQA 4/2", 2, 4, 37, 50, 40, 40, false, false, 1.0f, false,
             kAdditiveMask, 2},
            {-kU, kU, -7, 0.0f, 0.0625f}),
      seed++);
  // Packed (varlen) batches: each block on its own sequence's rows, keys, band and slopes.
  run_packed_cases<__half, 64>(64, 48, seed), seed += 10;
  run_packed_cases<__nv_bfloat16, 128>(128, 96, seed), seed += 10;
  g_failures += packed_emulation::g_failures;
  if (g_failures != 0) {
    std::fprintf(stderr, "attn_ext_cuda_fwd_mma_emulation_tests: %d mismatch(es)\n", g_failures);
    return 1;
  }
  std::printf("attn_ext_cuda_fwd_mma_emulation_tests: all cases passed\n");
  return 0;
}
