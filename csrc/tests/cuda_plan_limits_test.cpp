// The launch plans' tile choice for the opt-in shared memory per block of every GPU generation the
// package is built for (common/smem_limits.h): each plan fits the limit, or is refused with the
// kernel, the bytes its smallest tile needs and the limit; the tensor-core plans refuse bf16 below
// compute capability 8.0 with the device's capability (common/compute_capability.h). The preferred tile is kept wherever it
// fits (sm_80 and sm_90 plans are the preferred ones), and the compiled fall-backs lose nothing
// against compiling every smaller tile. Prints the table that docs/backends.md summarises.
//
// Plain C++ (no emulator): the plans are what the launchers and the torch bindings compute.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "batched_cholesky_plan.h"
#include "check.h"
#include "attention_bwd_plan.h"
#include "attention_fwd_plan.h"
#include "intention_plan.h"
#include "small_gemm_plan.h"
#include "tree_plan.h"

namespace {

using namespace attn_ext::cuda;
using attn_ext::ScalarType;

struct Arch {
  const char* name;
  std::size_t limit;  ///< cudaDevAttrMaxSharedMemoryPerBlockOptin
  int capability;     ///< major·10 + minor
};
constexpr Arch kArchs[] = {{"sm_70", 98304, 70},   {"sm_75", 65536, 75},   {"sm_80", 166912, 80},
                           {"sm_86", 101376, 86}, {"sm_89", 101376, 89}, {"sm_90", 232448, 90}};
/// The capability the sweep of in-between limits assumes: tensor cores that take every dtype.
constexpr int kSweepCapability = 90;
constexpr bool keeps_preferred(const Arch& a) { return a.limit >= kSmemSm80Bytes; }
constexpr int kBuckets[] = {32, 64, 128, 256};

/// Every refusal of the loops below, "kernel bucket arch", to compare with the documented list.
std::vector<std::string> g_refused;
/// Every bf16 refusal for the device's compute capability, "kernel bucket arch".
std::vector<std::string> g_refused_bf16;

/// A tensor-core plan for `dt` on a device of `capability`: bf16 below 8.0 is refused with the
/// reason naming the device's capability (a device limit, not a shared-memory one); returns whether
/// it was (the caller then checks nothing else).
template <typename Plan>
bool check_capability_refusal(const Plan& p, ScalarType dt, int capability, const std::string& name) {
  if (dt != ScalarType::kBFloat16 || capability >= 80) {
    CHECK(tensor_core_dtype_error(dt, capability) == nullptr);
    return false;
  }
  CHECK(!p.supported && p.smem.kernel == nullptr && is_capability_error(p.error));
  const std::string message = plan_error_message(p.error, p.smem);
  const std::string expected = "bf16 needs compute capability 8.0; this device is " +
                               std::to_string(capability / 10) + "." + std::to_string(capability % 10);
  CHECK(message.rfind(expected, 0) == 0);
  g_refused_bf16.push_back(name);
  return true;
}

/// A plan refused for shared memory names the kernel, the bytes of its smallest tile and the limit.
template <typename Plan>
void check_refusal(const Plan& p, std::size_t limit, std::size_t smallest_bytes) {
  CHECK(!p.supported && p.error == kSmemShortfallError && p.smem.kernel != nullptr);
  CHECK(p.smem.needed_bytes == smallest_bytes && p.smem.needed_bytes > limit && p.smem.limit_bytes == limit);
  const std::string message = plan_error_message(p.error, p.smem);
  CHECK(message.find(p.smem.kernel) != std::string::npos);
  CHECK(message.find(std::to_string(smallest_bytes)) != std::string::npos);
  CHECK(message.find(std::to_string(limit)) != std::string::npos);
}

/// One row of the printed table: the tile and bytes each architecture gets.
struct Row {
  std::string what;
  std::string cells[6];
};
std::vector<Row> g_rows;

/// Records an architecture's plan: its cell in table row `row` (if row >= 0) and, if refused, `name`.
void record(int row, int arch, bool supported, int tile, std::size_t bytes, const char* unit, const std::string& name) {
  if (row >= 0) {
    g_rows[static_cast<size_t>(row)].cells[arch] =
        supported ? std::to_string(tile) + unit + " " + std::to_string(bytes) : std::string("refused");
  }
  if (!supported) g_refused.push_back(name + " " + kArchs[arch].name);
}

/// The tile a plan of a kernel whose tiles halve must pick (common/smem_limits.h): the largest
/// compiled tile that fits, refused with the smallest compiled tile's bytes if none does. At the
/// architectures' limits (not in the sweep), that is also the largest of every halving: the compiled
/// fall-backs lose nothing. Returns it (0: refused).
template <typename Plan, typename Bytes>
int expected_tile(const Plan& p, int preferred, std::size_t limit, Bytes bytes, bool sweep) {
  const int best = compiled_tile_within(preferred, limit, bytes);
  if (!sweep) CHECK(best == largest_tile_within(preferred, limit, bytes));
  if (best == 0) check_refusal(p, limit, bytes(smallest_compiled_tile(preferred, bytes)));
  return best;
}

/// Table row of a head-dim bucket, from the row of bucket 32.
int bucket_row(int first, int dim) { return first + (dim == 32 ? 0 : dim == 64 ? 1 : dim == 128 ? 2 : 3); }

/// Forward, fp32 (rows per warp) and fp16/bf16 (warps) for every bucket at every limit.
void forward_plans(std::size_t limit, int capability, int arch, bool sweep) {
  for (int d : kBuckets) {
    for (int dv : kBuckets) {
      const CrossAttentionFwdSmemOfRows bytes{d, dv};
      const int preferred = cross_attention_fwd_rows_per_warp(dv);
      const CrossAttentionLaunchPlan p = plan_cross_attention_fwd(2, 3, 100, 70, d, dv, ScalarType::kFloat32, limit,
                                                                  capability);
      const int best = expected_tile(p, preferred, limit, bytes, sweep);
      if (best != 0) {
        CHECK(p.supported && p.rows_per_warp == best && cross_attention_fwd_rows_compiled(d, dv, best));
        CHECK(p.shared_memory_bytes == bytes(best) && p.shared_memory_bytes <= limit && p.block.x == 128);
        CHECK(p.block_m == 4 * best && p.grid.x == 2u * 3 * ((100 + p.block_m - 1) / p.block_m));
      }
      if (sweep) continue;
      if (keeps_preferred(kArchs[arch])) CHECK(p.rows_per_warp == preferred);
      // Only D = 256 differs between the devices: one table row per Dv.
      record(d == 256 ? bucket_row(0, dv) : -1, arch, p.supported, p.rows_per_warp, p.shared_memory_bytes, "r",
             "fwd fp32 " + std::to_string(d) + "x" + std::to_string(dv));
    }
  }
  for (ScalarType dt : {ScalarType::kFloat16, ScalarType::kBFloat16}) {
    for (int dim : kBuckets) {
      const CrossAttentionWmmaSmemOfWarps bytes{dim};
      const CrossAttentionLaunchPlan p = plan_cross_attention_fwd(2, 3, 100, 70, dim, dim / 2, dt, limit, capability);
      if (check_capability_refusal(p, dt, capability, "fwd wmma " + std::to_string(dim) + " " + kArchs[arch].name)) {
        continue;
      }
      const int best = expected_tile(p, kCrossAttentionWmmaWarps, limit, bytes, sweep);
      if (best != 0) {
        CHECK(p.supported && p.warps == best && cross_attention_wmma_warps_compiled(dim, best));
        CHECK(p.shared_memory_bytes == bytes(best) && p.shared_memory_bytes <= limit);
        CHECK(p.block.x == 32u * best && p.block_m == 16 * best && p.rows_per_warp == 16);
      }
      if (sweep || dt != ScalarType::kFloat16) continue;
      if (keeps_preferred(kArchs[arch])) CHECK(p.warps == kCrossAttentionWmmaWarps);
      record(bucket_row(4, dim), arch, p.supported, p.warps, p.shared_memory_bytes, "w", "fwd wmma " + std::to_string(dim));
    }
  }
}

/// Backward: fp32 (tile rows, runtime D and Dv) and fp16/bf16 (warps) at every limit.
void backward_plans(std::size_t limit, int capability, int arch, bool sweep) {
  for (int d : {1, 32, 59, 64, 128, 200, 256}) {
    for (int dv : {1, 32, 64, 100, 128, 256}) {
      const CrossAttentionBwdPlan p = plan_cross_attention_bwd(2, 3, 50, 70, d, dv, ScalarType::kFloat32, limit,
                                                               capability);
      const bool big = cross_attention_bwd_simt_bytes(d, dv, kCrossAttentionBwdTile) <= limit;
      const bool small = cross_attention_bwd_simt_bytes(d, dv, kCrossAttentionBwdSmallTile) <= limit;
      if (!small) {
        check_refusal(p, limit, cross_attention_bwd_simt_bytes(d, dv, kCrossAttentionBwdSmallTile));
      } else {
        CHECK(p.supported && p.tile == (big ? 16 : 8) && p.dkdv_smem_bytes <= limit && p.dq_smem_bytes <= limit);
        CHECK(p.dkdv_grid.x == 2u * 3 * ((70 + p.tile - 1) / p.tile));
        CHECK(p.dq_grid.x == 2u * 3 * ((50 + p.tile - 1) / p.tile));
      }
      if (sweep) continue;
      if (keeps_preferred(kArchs[arch])) CHECK(p.tile == kCrossAttentionBwdTile);
      const int row = d == 256 && dv == 128 ? 8 : d == 256 && dv == 256 ? 9 : -1;
      record(row, arch, p.supported, p.tile, p.dkdv_smem_bytes, "t",
             "bwd fp32 " + std::to_string(d) + "x" + std::to_string(dv));
    }
  }
  if (!sweep) {
    // The documented thresholds of the fp32 backward's 8-row tiles: D + Dv > 498 on sm_70, > 328 on sm_75.
    const int threshold = kArchs[arch].limit == 98304 ? 498 : kArchs[arch].limit == 65536 ? 328 : 512;
    for (int sum : {threshold - 1, threshold, threshold + 1}) {
      if (sum > 512) continue;
      const int d = sum / 2, dv = sum - d;
      CHECK(plan_cross_attention_bwd(1, 1, 9, 9, d, dv, ScalarType::kFloat32, limit, capability).tile ==
            (sum > threshold ? 8 : 16));
    }
  }
  for (ScalarType dt : {ScalarType::kFloat16, ScalarType::kBFloat16}) {
    for (int dim : kBuckets) {
      const CrossAttentionBwdWmmaSmemOfWarps bytes{dim};
      const int preferred = cross_attention_bwd_wmma_preferred_warps(dim);
      const CrossAttentionBwdPlan p = plan_cross_attention_bwd(2, 3, 50, 70, dim / 2, dim, dt, limit, capability);
      if (check_capability_refusal(p, dt, capability, "bwd wmma " + std::to_string(dim) + " " + kArchs[arch].name)) {
        continue;
      }
      const int best = expected_tile(p, preferred, limit, bytes, sweep);
      if (best != 0) {
        CHECK(p.supported && p.warps == best && cross_attention_bwd_wmma_warps_compiled(dim, best));
        CHECK(p.dkdv_smem_bytes == bytes(best) && p.dkdv_smem_bytes <= limit && p.dq_smem_bytes <= p.dkdv_smem_bytes);
        CHECK(p.block.x == 32u * best && p.dkdv_grid.x == 2u * 3 * ((70 + 16 * best - 1) / (16 * best)));
      }
      if (sweep || dt != ScalarType::kFloat16) continue;
      if (keeps_preferred(kArchs[arch])) CHECK(p.warps == preferred);
      record(bucket_row(10, dim), arch, p.supported, p.warps, p.dkdv_smem_bytes, "w", "bwd wmma " + std::to_string(dim));
    }
  }
}

/// Cholesky (and so Intention, whose factor is fp32 with n = D ≤ 128), tree and GEMM at every limit.
void other_plans(std::size_t limit, int arch, bool sweep) {
  for (ScalarType dt : {ScalarType::kFloat32, ScalarType::kFloat64}) {
    int largest_n = 0;
    for (int n = 1; n <= kCholeskyMaxDim; ++n) {
      const CholeskyLaunchPlan p = plan_batched_cholesky(3, n, 5, dt, limit);
      const bool padded = cholesky_smem_bytes(n, dt, true) <= limit;
      const bool unpadded = dt == ScalarType::kFloat32 && cholesky_smem_bytes(n, dt, false) <= limit;
      if (!padded && !unpadded) {
        check_refusal(p, limit, cholesky_smem_bytes(n, dt, dt != ScalarType::kFloat32));
        continue;
      }
      CHECK(p.supported && p.padded_rows == padded && p.shared_memory_bytes <= limit);
      largest_n = n;
    }
    if (sweep) continue;
    // The documented largest n: every n in float32, and in float64 per sm_70, 75, 80, 86, 89, 90.
    constexpr int kLargestFp64[] = {110, 90, 128, 112, 112, 128};
    CHECK(largest_n == (dt == ScalarType::kFloat32 ? kCholeskyMaxDim : kLargestFp64[arch]));
    g_rows[static_cast<size_t>(dt == ScalarType::kFloat32 ? 14 : 15)].cells[arch] = "n<=" + std::to_string(largest_n);
  }
  IntentionFwdParams f;
  int dummy = 0;
  f.in.B = 2, f.in.H = 3, f.in.M = 9, f.in.N = 40, f.in.D = 128, f.in.Dv = 64, f.in.k = &dummy, f.in.v = &dummy;
  f.in.has_values = true;
  // Every device (≥ 64 KiB) runs D <= 128: the factor is fp32, unpadded on 64 KiB.
  const IntentionPlan ip = plan_intention_fwd(f, limit);
  if (limit >= cholesky_smem_bytes(128, ScalarType::kFloat32, false)) {
    CHECK(ip.supported);
  } else {
    check_refusal(ip, limit, cholesky_smem_bytes(128, ScalarType::kFloat32, false));
  }
  CHECK(plan_small_gemm(6, 70, 33, limit).supported);
  // Tree: one query per warp is the smallest tile, so a per-warp state either fits or is refused.
  for (int H : {1, 8, 16, 21, 32}) {
    for (int dim : {64, 256, 384}) {
      for (bool backward : {false, true}) {
        const TreeLaunchPlan p = plan_tree_cross_attention(2, 5, H, dim, dim, 2, 8, 6, backward, limit);
        const std::size_t warp = static_cast<std::size_t>(tree_warp_layout(H, dim, dim, 2, 8, 6, backward).bytes);
        if (warp > limit) {
          check_refusal(p, limit, warp);
        } else {
          CHECK(p.supported && p.shared_memory_bytes <= limit && p.warp_bytes == warp);
          // The warp count depends on the 48 KiB of a launch without opt-in only: the same on every device.
          CHECK(p.shared_memory_bytes == p.warps * warp);
          CHECK(p.warps == 1 || p.shared_memory_bytes <= kDefaultDynamicSmemBytes);
        }
      }
    }
  }
}

void print_table() {
  std::printf("%-34s", "kernel / bucket (tile, bytes)");
  for (const Arch& a : kArchs) std::printf(" | %-14s", a.name);
  std::printf("\n");
  for (const Row& r : g_rows) {
    std::printf("%-34s", r.what.c_str());
    for (const std::string& c : r.cells) std::printf(" | %-14s", c.c_str());
    std::printf("\n");
  }
}

}  // namespace

int main() {
  for (const char* what : {"fwd fp32 D=256 Dv=32 (rows/warp)", "fwd fp32 D=256 Dv=64", "fwd fp32 D=256 Dv=128",
                           "fwd fp32 D=256 Dv=256", "fwd fp16/bf16 32 (warps)", "fwd fp16/bf16 64",
                           "fwd fp16/bf16 128", "fwd fp16/bf16 256", "bwd fp32 D=256 Dv=128 (tile)",
                           "bwd fp32 D=Dv=256", "bwd fp16/bf16 32 (warps)", "bwd fp16/bf16 64", "bwd fp16/bf16 128",
                           "bwd fp16/bf16 256", "cholesky fp32 (largest n)", "cholesky fp64 (largest n)"}) {
    g_rows.push_back(Row{what, {}});
  }
  for (int a = 0; a < 6; ++a) {
    forward_plans(kArchs[a].limit, kArchs[a].capability, a, false);
    backward_plans(kArchs[a].limit, kArchs[a].capability, a, false);
    other_plans(kArchs[a].limit, a, false);
  }
  // The documented refusals (docs/backends.md): only sm_75's 64 KiB turns shapes away, and only the
  // widest. (Cholesky in fp64 and the tree's per-query state are bounded by n and H·(D + Dv) instead.)
  const std::vector<std::string> documented = {"fwd fp32 256x256 sm_75", "bwd wmma 256 sm_75"};
  CHECK(g_refused == documented);
  for (const std::string& r : g_refused) std::printf("refused: %s\n", r.c_str());
  // bf16 on the tensor cores: refused on sm_70 and sm_75 (every bucket, forward and backward), run
  // everywhere else; fp16 and fp32 ran on every architecture above (or met the shared-memory refusals).
  std::vector<std::string> bf16_documented;
  for (const char* arch : {"sm_70", "sm_75"}) {
    for (const char* kernel : {"fwd wmma ", "bwd wmma "}) {
      for (int dim : kBuckets) bf16_documented.push_back(kernel + std::to_string(dim) + " " + arch);
    }
  }
  std::sort(g_refused_bf16.begin(), g_refused_bf16.end());
  std::sort(bf16_documented.begin(), bf16_documented.end());
  CHECK(g_refused_bf16 == bf16_documented);
  std::printf("refused for bf16 on sm_70 and sm_75 (every bucket, forward and backward): %s\n",
              tensor_core_dtype_error(ScalarType::kBFloat16, 75));
  // Any limit in between (future devices): plans still fit or are refused with a full reason.
  for (std::size_t limit = 48 * 1024; limit <= 240 * 1024; limit += 512) {
    forward_plans(limit, kSweepCapability, 0, true);
    backward_plans(limit, kSweepCapability, 0, true);
    other_plans(limit, 0, true);
  }
  print_table();
  if (attn_ext_tests::g_failures != 0) {
    std::fprintf(stderr, "attn_ext_cuda_plan_limits_tests: %d failure(s)\n", attn_ext_tests::g_failures);
    return 1;
  }
  std::printf("attn_ext_cuda_plan_limits_tests: all checks passed\n");
  return 0;
}
