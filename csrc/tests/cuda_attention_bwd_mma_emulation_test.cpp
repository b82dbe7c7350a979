// Runs the FlashAttention-2-style backward kernels' source (attention_bwd_mma_kernel.cuh) on the host, after
// the Δ pre-pass, with the emulator's mma.sync / ldmatrix / cp.async (cuda_emulation/mma_sm80_emulation.h),
// against the double reference of cuda_attention_bwd_emulation_case.h: head-dim buckets 32, 64 and 128,
// fp16 and bf16, row and key tails, padded keys (a fully padded batch) with NaN behind them, a NaN query
// row, M = 0 and N = 0, the causal rule with M ≠ N, bool and additive attn_mask views with a NaN key and a
// NaN query row masked for every pair that reads them (the exact products), and GQA (dK/dV summed over the
// group in one block). Inputs are laid out on 16-byte row boundaries, as the kernels require.
#include <type_traits>

#include "attention_bwd_kernel.cuh"  // the Δ pre-pass
#include "attention_bwd_mma_kernel.cuh"
#include "attention_bwd_mma_plan.h"
#include "attention_fwd_mma_plan.h"
#include "cuda_attention_bwd_emulation_case.h"
#include "cuda_packed_emulation_case.h"

namespace {

using namespace bwd_emulation;
using attn_ext::cuda::CrossAttentionBwdParams;

bool has_pair_masks(const Case& c) { return c.causal || c.attn_mask != kNoAttnMask || c.rules.any(); }
bool has_pair_masks(const packed_emulation::PackedCase& c) { return c.pair_masks(); }

/// One case, dense (cuda_attention_bwd_emulation_case.h) or packed (cuda_packed_emulation_case.h).
template <typename scalar_t, int kDim, typename C = Case>
void run_case(C c, uint32_t seed) {
  c.aligned = true;
  const bool pair = has_pair_masks(c);
  const auto kernels = [&](const CrossAttentionBwdParams& p) -> bool {
    namespace det = attn_ext::cuda::detail;
    using L = det::MmaBwdLayout<kDim>;
    const char* why = attn_ext::cuda::mma_qkv_ineligible(80, p.D, p.Dv, p.q, p.k, p.v, p,
                                                         {p.dout_stride_b, p.dout_stride_h, p.dout_stride_m});
    const int dim = attn_ext::cuda::cross_attention_fwd_head_dim_instantiation(p.D > p.Dv ? p.D : p.Dv);
    if (why != nullptr || dim != kDim) {
      fail(c, why != nullptr ? why : "the case's head dims are not the tested bucket", 0, dim, kDim);
      return false;
    }
    const attn_ext::cuda::CrossAttentionBwdPlan plan = attn_ext::cuda::plan_cross_attention_bwd(
        p.B, p.H, p.M, p.N, p.D, p.Dv, p.dtype, kSm90, kEveryDtypeCapability, p.kv_group);
    void* smem = det::smem_raw;
    const size_t smem_total = sizeof(det::smem_raw);
    const auto blocks = [&](int64_t rows, int64_t heads) {
      return dim3(static_cast<unsigned int>(p.B * heads * ((rows + L::kOwn - 1) / L::kOwn)));
    };
    const dim3 block(L::kThreads);
    bool ok = cuda_emu::run_grid(dim3(attn_ext::cuda::cross_attention_bwd_delta_grid(p, plan)),
                                 dim3(plan.delta_block.x), smem, smem_total, 0,
                                 [&] { det::cross_attention_bwd_delta_kernel<scalar_t>(p); });
    if (pair) {
      ok &= cuda_emu::run_grid(blocks(p.N, p.H / p.kv_group), block, smem, smem_total, L::kBytes,
                               [&] { det::attention_bwd_mma_kernel<scalar_t, kDim, true, true>(p); });
      ok &= cuda_emu::run_grid(blocks(p.M, p.H), block, smem, smem_total, L::kBytes,
                               [&] { det::attention_bwd_mma_kernel<scalar_t, kDim, false, true>(p); });
    } else {
      ok &= cuda_emu::run_grid(blocks(p.N, p.H / p.kv_group), block, smem, smem_total, L::kBytes,
                               [&] { det::attention_bwd_mma_kernel<scalar_t, kDim, true, false>(p); });
      ok &= cuda_emu::run_grid(blocks(p.M, p.H), block, smem, smem_total, L::kBytes,
                               [&] { det::attention_bwd_mma_kernel<scalar_t, kDim, false, false>(p); });
    }
    return ok;
  };
  if constexpr (std::is_same_v<C, Case>) {
    run_backward_case<scalar_t>(c, seed, kernels);
  } else {
    packed_emulation::run_packed_backward<scalar_t>(c, seed, kernels);
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
  uint32_t seed = 211;
  // name, B, H, M, N, D, Dv, mask (last batch fully padded)[, causal, attn_mask, kv_group]
  run_case<__half, 64>({"mma fp16 D=64 Dv=32 masked", 2, 2, 37, 70, 64, 32, true}, seed++);
  run_case<__half, 64>({"mma fp16 M=2 N=239 D=40 masked", 2, 1, 2, 239, 40, 40, true}, seed++);
  run_case<__nv_bfloat16, 128>({"mma bf16 M=130 N=203 D=128", 1, 1, 130, 203, 128, 128, false}, seed++);
  run_case<__nv_bfloat16, 128>({"mma bf16 D=96 Dv=128 masked", 2, 1, 40, 70, 96, 128, true}, seed++);
  run_case<__half, 32>({"mma fp16 N=0", 1, 2, 9, 0, 8, 8, false}, seed++);
  run_case<__half, 32>({"mma fp16 M=0", 1, 2, 0, 9, 16, 8, false}, seed++);
  run_case<__half, 64>({"mma fp16 causal + bool + padded, GQA 4/2", 2, 4, 70, 70, 40, 56, true, true, kBoolMask, 2},
                       seed++);
  run_case<__half, 32>({"mma fp16 additive attn_mask", 2, 2, 37, 50, 32, 16, false, false, kAdditiveMask}, seed++);
  run_case<__nv_bfloat16, 128>(
      {"mma bf16 additive + causal M=N=100, GQA 2/1", 2, 2, 100, 100, 96, 96, true, true, kAdditiveMask, 2}, seed++);
  run_case<__nv_bfloat16, 64>({"mma bf16 GQA 3/1, no pair mask", 2, 3, 33, 40, 64, 64, true, false, kNoAttnMask, 3},
                              seed++);
  run_case<__half, 64>({"mma fp16 causal M=10 N=90 (keys past M)", 1, 1, 10, 90, 48, 48, false, true}, seed++);
  run_case<__half, 128>({"mma fp16 causal M=90 N=20", 2, 1, 90, 20, 128, 128, true, true}, seed++);
  // Score rules (ScoreRules: band_lo, band_hi, diagonal, softcap, alibi with head h's slope alibi·(h + 1)): the
  // streamed tiles outside a band skipped, the soft cap's factor in dS, ALiBi over an additive mask with GQA.
  run_case<__half, 64>(
      ruled({"mma fp16 window (20, 0) bottom-right M=70 N=300", 1, 2, 70, 300, 64, 64, false}, {210, 230, 230}),
      seed++);
  run_case<__nv_bfloat16, 128>(
      ruled({"mma bf16 window (30, 9) + softcap + ALiBi, padded", 2, 2, 130, 150, 128, 128, true},
            {-30, 9, 0, 1.0f, 0.25f}),
      seed++);
  run_case<__half, 32>(
      ruled({"mma fp16 band (25, 25): rows without keys", 1, 1, 40, 30, 32, 32, false}, {25, 25, 0}), seed++);
  run_case<__half, 64>(
      ruled({"mma fp16 ALiBi (diagonal -7) + additive, GQA 4/2", 2, 4, 37, 50, 40, 40, false, false, kAdditiveMask,
             2},
            {-kU, kU, -7, 0.0f, 0.0625f}),
      seed++);
  // Packed (varlen) batches: each block on its own sequence's rows, keys, band and slopes.
  for (const packed_emulation::PackedCase& c : packed_emulation::packed_cases(64, 40)) run_case<__half, 64>(c, seed++);
  for (const packed_emulation::PackedCase& c : packed_emulation::packed_cases(128, 96)) {
    run_case<__nv_bfloat16, 128>(c, seed++);
  }
  g_failures += packed_emulation::g_failures;
  if (g_failures != 0) {
    std::fprintf(stderr, "attn_ext_cuda_attention_bwd_mma_emulation_tests: %d failure(s)\n", g_failures);
    return 1;
  }
  std::printf("attn_ext_cuda_attention_bwd_mma_emulation_tests: all cases passed\n");
  return 0;
}
