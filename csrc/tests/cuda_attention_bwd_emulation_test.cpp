// Runs the CUDA cross-attention backward kernels' source on the host (cuda_emulation/) against a
// double-precision reference of docs/spec.md §1's backward computed from the same rounded inputs and the
// same saved (out, lse), and checks plan_cross_attention_bwd().
//
// Inputs are strided views with NaN in every element the kernels must not read (row padding, the
// rows past N); the last batch's keys are all padding when masked (its rows must get zero grads);
// grad_lse is nonzero. Shared memory past the planned size must stay untouched. Masked cases also
// hold NaN in the padded keys' k and v rows (never read: zero gradients there, no NaN elsewhere) and
// a NaN query element, whose row is NaN (out and lse) and passes NaN gradients to its head's keys.
#include "attention_bwd_kernel.cuh"
#include "attention_bwd_wmma_kernel.cuh"
#include "cuda_attention_bwd_emulation_case.h"
#include "cuda_packed_emulation_case.h"


namespace {

using namespace bwd_emulation;
using attn_ext::cuda::CrossAttentionBwdParams;
using attn_ext::cuda::CrossAttentionBwdPlan;

/// The preferred tile: 16-row tiles (fp32, kDim = 0) or the bucket's preferred warp count.
constexpr int preferred_tile(int dim) {
  return dim == 0 ? attn_ext::cuda::kCrossAttentionBwdTile : attn_ext::cuda::cross_attention_bwd_wmma_preferred_warps(dim);
}

/// The Δ pre-pass and both gradient kernels of a plan under the emulator: SIMT (kDim = 0, kTile-row tiles) or
/// WMMA (that head-dim bucket, kTile warps); false when one wrote shared memory past its plan.
template <typename scalar_t, int kDim, int kTile, bool kPair>
bool run_kernels(const CrossAttentionBwdParams& p, const CrossAttentionBwdPlan& plan) {
  void* smem = attn_ext::cuda::detail::smem_raw;
  const size_t smem_total = sizeof(attn_ext::cuda::detail::smem_raw);
  const auto dims = [](attn_ext::cuda::LaunchDims d) { return dim3(d.x, d.y, d.z); };
  namespace det = attn_ext::cuda::detail;
  bool ok = cuda_emu::run_grid(dim3(attn_ext::cuda::cross_attention_bwd_delta_grid(p, plan)), dims(plan.delta_block),
                               smem, smem_total, 0, [&] { det::cross_attention_bwd_delta_kernel<scalar_t>(p); });
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
  return ok;
}

/// kDim = 0: the SIMT kernels (fp32) with kTile-row tiles; else the tensor-core kernels of that
/// head-dim bucket (fp16/bf16) with kTile warps; the plan for `smem_limit` must pick them.
/// kPair: the pair-mask instantiations (the case must have causal or attn_mask).
template <typename scalar_t, int kDim = 0, int kTile = preferred_tile(kDim), bool kPair = false>
void run_case(const Case& c, uint32_t seed, std::size_t smem_limit = kSm90) {
  if (kPair != (c.causal || c.attn_mask != kNoAttnMask || c.rules.any())) return fail(c, "kPair must match the case", 0, 0, 0);
  const auto kernels = [&](const CrossAttentionBwdParams& p) -> bool {
    const CrossAttentionBwdPlan plan = attn_ext::cuda::plan_cross_attention_bwd(
        p.B, p.H, p.M, p.N, p.D, p.Dv, p.dtype, smem_limit, kEveryDtypeCapability, p.kv_group);
    const auto refuse = [&](const char* why, double got, double want) {
      fail(c, why, 0, got, want);
      return false;
    };
    if (!plan.supported) return refuse("plan rejected the case", 0, 0);
    if ((kDim > 0 ? plan.warps : plan.tile) != kTile) return refuse("plan picks another tile", plan.warps, kTile);
    if (plan.dkdv_smem_bytes > smem_limit || plan.dq_smem_bytes > smem_limit) fail(c, "plan exceeds the limit", 0, 0, 0);
    if (plan.tensor_cores != (kDim > 0) || plan.dim != kDim) return refuse("plan picks another kernel", plan.dim, kDim);
    return run_kernels<scalar_t, kDim, kTile, kPair>(p, plan);
  };
  run_backward_case<scalar_t>(c, seed, kernels);
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


/// The packed cases (cuda_packed_emulation_case.h) with the preferred tiles: SIMT (kDim = 0) or WMMA of that
/// head-dim bucket, without and with pair masks.
template <typename scalar_t, int kDim = 0>
void run_packed_cases(int64_t D, int64_t Dv, uint32_t seed) {
  constexpr int kTile = preferred_tile(kDim);
  for (const packed_emulation::PackedCase& c : packed_emulation::packed_cases(D, Dv)) {
    const auto kernels = [&](const CrossAttentionBwdParams& p) -> bool {
      const CrossAttentionBwdPlan plan = attn_ext::cuda::plan_cross_attention_bwd(
          p.B, p.H, p.M, p.N, p.D, p.Dv, p.dtype, kSm90, kEveryDtypeCapability, p.kv_group);
      if (!plan.supported || (kDim > 0 ? plan.warps : plan.tile) != kTile || plan.dim != kDim) {
        packed_emulation::fail(c, "plan does not select the tested kernels", 0, plan.dim, kDim);
        return true;
      }
      return p.has_pair_masks() ? run_kernels<scalar_t, kDim, kTile, true>(p, plan)
                                : run_kernels<scalar_t, kDim, kTile, false>(p, plan);
    };
    packed_emulation::run_packed_backward<scalar_t>(c, seed++, kernels);
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
      {"fp32 additive + causal, M=40 N=23", 2, 2, 40, 23, 16, 16, true, true, kAdditiveMask}, seed++);
  run_case<float, 0, 16, true>({"fp32 causal M=10 N=50 (keys past M)", 1, 1, 10, 50, 8, 8, false, true}, seed++);
  run_case<float>({"fp32 GQA 6/3, no pair mask", 2, 6, 20, 33, 16, 16, true, false, kNoAttnMask, 3}, seed++);
  run_case<__half, 64, 4, true>(
      {"fp16 causal + bool + padded, GQA 4/2", 2, 4, 70, 70, 40, 59, true, true, kBoolMask, 2}, seed++);
  run_case<__half, 32, 4, true>({"fp16 additive attn_mask", 2, 2, 37, 50, 32, 16, false, false, kAdditiveMask}, seed++);
  run_case<__nv_bfloat16, 128, 4, true>(
      {"bf16 additive + causal M=N=100, GQA 2/1", 2, 2, 100, 100, 96, 96, true, true, kAdditiveMask, 2}, seed++);
  run_case<__nv_bfloat16, 64, 4>({"bf16 GQA 3/1, no pair mask", 2, 3, 33, 40, 64, 64, true, false, kNoAttnMask, 3},
                                  seed++);
  run_case<__half, 128, 1, true>({"fp16 bool causal, 64 KiB: 1 warp", 1, 2, 40, 35, 128, 128, false, true, kBoolMask},
                                 seed++, kSm75);
  // Score rules (ScoreRules: band_lo, band_hi, diagonal, softcap, alibi with head h's slope alibi·(h + 1)): the
  // query and key tiles outside a band skipped, the soft cap's factor in dS, ALiBi over an additive mask.
  run_case<float, 0, 16, true>(
      ruled({"fp32 window (6, 0) bottom-right M=20 N=70", 1, 2, 20, 70, 24, 24, false}, {44, 50, 50}), seed++);
  run_case<float, 0, 16, true>(
      ruled({"fp32 window (5, 9) + softcap + ALiBi, padded", 2, 2, 45, 50, 16, 16, true}, {-5, 9, 0, 1.0f, 0.25f}),
      seed++);
  run_case<__half, 64, 4, true>(
      ruled({"fp16 band (25, 25): rows without keys", 1, 2, 40, 30, 40, 40, false}, {25, 25, 0}), seed++);
  run_case<__nv_bfloat16, 128, 4, true>(
      ruled({"bf16 ALiBi (diagonal 10) + softcap + additive, GQA 2/1", 2, 2, 60, 70, 96, 96, true, false,
             kAdditiveMask, 2},
            {-kU, kU, 10, 1.5f, 0.125f}),
      seed++);
  // Packed (varlen) batches: each block on its own sequence's rows, keys, band and slopes.
  run_packed_cases<float>(24, 40, seed), seed += 10;
  run_packed_cases<__half, 64>(64, 40, seed), seed += 10;
  run_packed_cases<__nv_bfloat16, 128>(96, 128, seed), seed += 10;
  g_failures += packed_emulation::g_failures;
  if (g_failures != 0) {
    std::fprintf(stderr, "attn_ext_cuda_attention_bwd_emulation_tests: %d failure(s)\n", g_failures);
    return 1;
  }
  std::printf("attn_ext_cuda_attention_bwd_emulation_tests: all cases passed\n");
  return 0;
}
