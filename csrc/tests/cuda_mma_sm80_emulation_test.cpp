// Tests of the host emulation of the sm_80 tensor-core primitives (common/mma_sm80.cuh, emulated by
// cuda_emulation/mma_sm80_emulation.h) against the PTX ISA's layouts and semantics, independently of
// any kernel, so that a kernel test failing under the emulator points at the kernel:
//  (a) every lane's every half of ldmatrix .x4/.x2 with and without .trans, from scattered rows of a
//      padded tile, against PTX's (row, column) formulas;
//  (b) a 16×16×16 product C = A·B + C0 per warp from ldmatrix + mma_m16n8k16, B stored [n][k] (Q·Kᵀ,
//      plain ldmatrix) and [k][n] (P·V, .trans), fp16 and bf16, against a double reference: this
//      checks that the ldmatrix and mma layouts compose into the product, which the kernels rely on;
//  (c) pack_pair's rounding (to nearest even) and order (lo in the low half);
//  (d) cp.async: zero-fill, data invisible before the wait and visible after, wait<1> leaving the
//      newest group pending, uncommitted copies in no group, empty groups counted, and a missing
//      __syncthreads after the wait showing up as stale data;
//  (e) what a GPU would fault on or leave undefined (misaligned addresses, copies never waited for,
//      a warp diverging around a collective) aborts the emulator: run in forked children.
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>

#include "check.h"
#include "common/mma_sm80.cuh"

namespace {

using attn_ext::cuda::detail::MmaA;
using attn_ext::cuda::detail::MmaB;
using attn_ext::cuda::detail::MmaC;
using attn_ext::cuda::detail::from_float;
using attn_ext::cuda::detail::to_float;
using attn_ext::cuda::detail::pack_pair;
namespace mma = attn_ext::cuda::detail;

/// The tests' shared memory: the emulator's (emulator_extras_tree.h), which shared_address() maps.
unsigned char* const g_smem = reinterpret_cast<unsigned char*>(attn_ext::cuda::detail::smem_raw);
constexpr size_t kSmemBytes = sizeof(attn_ext::cuda::detail::smem_raw);
using mma::shared_address;

void run_warps(int warps, const std::function<void()>& body) {
  cuda_emu::run_block(dim3(1), dim3(0), dim3(32 * warps), body);
}

// ---- (a) ldmatrix layouts ----------------------------------------------------------------------

constexpr int kTileRows = 32, kTileCols = 40;  // a padded row stride (80 bytes): rows not contiguous
uint16_t* layout_tile() { return reinterpret_cast<uint16_t*>(g_smem); }
uint16_t tile_value(int r, int c) { return static_cast<uint16_t>(r * 64 + c + 1); }  // distinct
/// Where each 8×8 matrix starts: scattered, overlapping none of the others (columns multiples of 8
/// keep the rows 16-byte aligned).
struct Origin {
  int row, col;
};
constexpr Origin kOrigins[4] = {{3, 16}, {20, 0}, {9, 32}, {0, 8}};

void test_ldmatrix_layouts() {
  for (int r = 0; r < kTileRows; ++r)
    for (int c = 0; c < kTileCols; ++c) layout_tile()[r * kTileCols + c] = tile_value(r, c);
  uint32_t got[5][32][4] = {};  // [x4, x4.trans, x2, x2.trans, x4 again][lane][register]
  run_warps(1, [&] {
    const int lane = static_cast<int>(threadIdx.x);
    const Origin o = kOrigins[lane / 8];  // PTX: lanes 8m..8m+7 give rows 0..7 of matrix m
    const uint16_t* row = layout_tile() + (o.row + lane % 8) * kTileCols + o.col;
    // .x2 reads lanes 0..15's addresses only: the others point at other data, which must not appear.
    const uint16_t* row_x2 = lane < 16 ? row : layout_tile() + (kTileRows - 1) * kTileCols + 24;
    uint32_t r4[4], r2[2];
    mma::ldmatrix_x4(r4, shared_address(row));
    std::memcpy(got[0][lane], r4, sizeof r4);
    mma::ldmatrix_x4_trans(r4, shared_address(row));
    std::memcpy(got[1][lane], r4, sizeof r4);
    mma::ldmatrix_x2(r2, shared_address(row_x2));
    std::memcpy(got[2][lane], r2, sizeof r2);
    mma::ldmatrix_x2_trans(r2, shared_address(row_x2));
    std::memcpy(got[3][lane], r2, sizeof r2);
    // A lane going on to overwrite its row at once must not change what the warp's ldmatrix read.
    mma::ldmatrix_x4(r4, shared_address(row));
    std::memset(layout_tile() + (o.row + lane % 8) * kTileCols + o.col, 0xff, 16);
    std::memcpy(got[4][lane], r4, sizeof r4);
  });
  for (int variant = 0; variant < 5; ++variant) {
    const bool trans = variant % 2 == 1 && variant < 4;
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, t = lane % 4;
      for (int m = 0; m < (variant == 2 || variant == 3 ? 2 : 4); ++m) {
        const Origin o = kOrigins[m];
        // PTX: (row l/4, cols 2(l%4), 2(l%4)+1); .trans: (rows 2(l%4), 2(l%4)+1; col l/4).
        const uint32_t lo = trans ? tile_value(o.row + 2 * t, o.col + g) : tile_value(o.row + g, o.col + 2 * t);
        const uint32_t hi = trans ? tile_value(o.row + 2 * t + 1, o.col + g) : tile_value(o.row + g, o.col + 2 * t + 1);
        if (got[variant][lane][m] != (lo | hi << 16)) {
          std::fprintf(stderr, "ldmatrix variant %d lane %d register %d: got %08x want %08x\n", variant, lane, m,
                       got[variant][lane][m], lo | hi << 16);
          CHECK(false);
        }
      }
    }
  }
}

// ---- (b) a product through ldmatrix + mma -------------------------------------------------------

constexpr int kStride = 24;  // elements per tile row: padded, 48 bytes (16-byte aligned)
template <typename scalar_t>
struct ProductTiles {
  scalar_t a[16][kStride];   // A [m][k]
  scalar_t bt[16][kStride];  // B stored [n][k], as K is for Q·Kᵀ
  scalar_t b[16][kStride];   // B stored [k][n], as V is for P·V
};

template <typename scalar_t>
void test_product(const char* name, uint32_t seed) {
  constexpr int kWarps = 2;  // each warp its own tiles: the mailboxes are per warp
  static_assert(sizeof(ProductTiles<scalar_t>) * kWarps <= kSmemBytes, "fits the test's shared memory");
  auto* tiles = reinterpret_cast<ProductTiles<scalar_t>*>(g_smem);
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  float c0[kWarps][16][16];
  for (int w = 0; w < kWarps; ++w)
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) {
        tiles[w].a[i][j] = from_float<scalar_t>(normal(gen));
        tiles[w].b[i][j] = from_float<scalar_t>(normal(gen));  // B[k = i][n = j]
        tiles[w].bt[j][i] = tiles[w].b[i][j];
        c0[w][i][j] = normal(gen);
      }
  float qk[kWarps][16][16], pv[kWarps][16][16];
  for (int w = 0; w < kWarps; ++w)
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) qk[w][i][j] = pv[w][i][j] = NAN;  // an element no lane writes fails
  run_warps(kWarps, [&] {
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
    const int g = lane / 4, t = lane % 4;
    const ProductTiles<scalar_t>& tl = tiles[warp];
    // Matrices (rows 0..7 | 8..15) × (cols 0..7 | 8..15) in the order of MmaA's registers.
    const int quad_row = (lane / 8 % 2) * 8 + lane % 8, quad_col = lane / 16 * 8;
    MmaA a;
    mma::ldmatrix_x4(a.r, shared_address(&tl.a[quad_row][quad_col]));
    uint32_t v[4];  // B[k][n] with .trans: {k 0..7, k 8..15} of n 0..7, then of n 8..15
    mma::ldmatrix_x4_trans(v, shared_address(&tl.b[quad_row][quad_col]));
    for (int nb = 0; nb < 2; ++nb) {
      MmaB bk;  // B[n][k] without .trans: n nb·8.., k 0..7 then 8..15 (lanes 16..31: ignored)
      mma::ldmatrix_x2(bk.r, shared_address(&tl.bt[nb * 8 + lane % 8][(lane / 8 % 2) * 8]));
      const MmaB bv{{v[2 * nb], v[2 * nb + 1]}};
      MmaC acc_qk, acc_pv;
      for (int i = 0; i < 4; ++i) {  // C layout: (row g (+8 for i >= 2), col 2t + i%2)
        acc_qk.r[i] = acc_pv.r[i] = c0[warp][g + 8 * (i / 2)][nb * 8 + 2 * t + i % 2];
      }
      mma::mma_m16n8k16<scalar_t>(acc_qk, a, bk);
      mma::mma_m16n8k16<scalar_t>(acc_pv, a, bv);
      for (int i = 0; i < 4; ++i) {
        qk[warp][g + 8 * (i / 2)][nb * 8 + 2 * t + i % 2] = acc_qk.r[i];
        pv[warp][g + 8 * (i / 2)][nb * 8 + 2 * t + i % 2] = acc_pv.r[i];
      }
    }
  });
  int bad = 0;
  for (int w = 0; w < kWarps; ++w)
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        double want = c0[w][m][n], magnitude = std::fabs(want);
        for (int k = 0; k < 16; ++k) {
          const double p = double(to_float(tiles[w].a[m][k])) * to_float(tiles[w].b[k][n]);
          want += p;
          magnitude += std::fabs(p);
        }
        // The bound of fp32 accumulation of 17 terms in any order (the hardware's order is unknown).
        const double tol = 17 * std::ldexp(1.0, -24) * magnitude;
        for (const float got : {qk[w][m][n], pv[w][m][n]}) {
          if (!(std::fabs(got - want) <= tol) && ++bad <= 5) {
            std::fprintf(stderr, "%s warp %d C[%d][%d]: got %.9g want %.9g\n", name, w, m, n, got, want);
          }
        }
      }
  CHECK(bad == 0);
}

// ---- (c) pack_pair --------------------------------------------------------------------------------

void test_pack_pair() {
  const float h = std::ldexp(1.0f, -10), b = std::ldexp(1.0f, -7);  // the ulp at 1.0 of fp16, bf16
  // Order: lo in the low half.
  CHECK(pack_pair<__half>(1.0f, -2.0f) == 0xC0003C00u);
  CHECK(pack_pair<__nv_bfloat16>(1.0f, -2.0f) == 0xC0003F80u);
  // Ties to even (1 + ulp/2 down to 1.0, 1 + 3 ulp/2 up to 1 + 2 ulp), above a tie rounds up (not
  // truncation), overflow to inf, -0 kept.
  CHECK(pack_pair<__half>(1.0f + h / 2, 1.0f + 3 * h / 2) == 0x3C023C00u);
  CHECK(pack_pair<__half>(1.0f + 0.75f * h, -0.0f) == 0x80003C01u);
  CHECK(pack_pair<__half>(65520.0f, -1e6f) == 0xFC007C00u);
  CHECK(pack_pair<__nv_bfloat16>(1.0f + b / 2, 1.0f + 3 * b / 2) == 0x3F823F80u);
  CHECK(pack_pair<__nv_bfloat16>(1.0f + b / 2 + std::ldexp(1.0f, -20), -0.0f) == 0x80003F81u);
  // Random values: the emulator's scalar conversions, in the same order.
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.0f, 100.0f);
  for (int i = 0; i < 1000; ++i) {
    const float lo = normal(gen), hi = normal(gen);
    CHECK(pack_pair<__half>(lo, hi) == (uint32_t(__float2half_rn(lo).bits) | uint32_t(__float2half_rn(hi).bits) << 16));
    CHECK(pack_pair<__nv_bfloat16>(lo, hi) ==
          (uint32_t(__float2bfloat16_rn(lo).bits) | uint32_t(__float2bfloat16_rn(hi).bits) << 16));
  }
}

// ---- (d) cp.async ------------------------------------------------------------------------------------

constexpr int kCopyThreads = 64;
constexpr uint32_t kStale = 0xABABABABu;  // shared memory's content before any copy lands
alignas(16) uint32_t g_src[kCopyThreads][3][4];

void test_cp_async() {
  auto* dst = reinterpret_cast<uint32_t(*)[3][4]>(g_smem);
  for (int i = 0; i < kCopyThreads; ++i)
    for (int c = 0; c < 3; ++c)
      for (int w = 0; w < 4; ++w) {
        g_src[i][c][w] = static_cast<uint32_t>(i * 100 + c * 10 + w + 1);
        dst[i][c][w] = kStale;
      }
  // snapshots[stage][thread][copy]: the first word of each destination after each step.
  uint32_t snapshots[4][kCopyThreads][3];
  uint32_t neighbour[kCopyThreads];
  run_warps(kCopyThreads / 32, [&] {
    const int i = static_cast<int>(threadIdx.x);
    const auto snapshot = [&](int stage) {
      for (int c = 0; c < 3; ++c) snapshots[stage][i][c] = dst[i][c][0];
    };
    mma::cp_async_16(dst[i][0], g_src[i][0], true);
    mma::cp_async_commit();
    mma::cp_async_16(dst[i][1], g_src[i][1], false);  // zero-fill: the source must not be read
    mma::cp_async_commit();
    mma::cp_async_16(dst[i][2], g_src[i][2], true);  // not committed: in no group yet
    snapshot(0);
    mma::cp_async_wait<1>();  // the oldest group lands, the newest stays pending
    snapshot(1);
    mma::cp_async_wait<0>();
    snapshot(2);
    mma::cp_async_commit();
    mma::cp_async_commit();  // an empty group (pipelines commit them at their tail) counts as one
    mma::cp_async_wait<1>();
    snapshot(3);
    __syncthreads();  // then every thread's copies are visible to the block
    neighbour[i] = dst[(i + 1) % kCopyThreads][0][3];
  });
  for (int i = 0; i < kCopyThreads; ++i) {
    const uint32_t s0 = g_src[i][0][0], s2 = g_src[i][2][0];
    const uint32_t want[4][3] = {{kStale, kStale, kStale}, {s0, kStale, kStale}, {s0, 0, kStale}, {s0, 0, s2}};
    for (int stage = 0; stage < 4; ++stage)
      for (int c = 0; c < 3; ++c) CHECK(snapshots[stage][i][c] == want[stage][c]);
    CHECK(std::memcmp(dst[i][0], g_src[i][0], 16) == 0 && std::memcmp(dst[i][2], g_src[i][2], 16) == 0);
    const uint32_t zeros[4] = {};
    CHECK(std::memcmp(dst[i][1], zeros, 16) == 0);
    CHECK(neighbour[i] == g_src[(i + 1) % kCopyThreads][0][3]);
  }
}

/// The copies land at each thread's own wait, so a kernel that reads other warps' copies without a
/// __syncthreads after the wait reads stale data in the warps scheduled first (here warp 0 reading
/// warp 1's rows), as it may on a GPU; with the barrier every warp reads the copies.
void test_cp_async_needs_barrier() {
  auto* rows = reinterpret_cast<uint32_t(*)[4]>(g_smem + 4096);  // one 16-byte row per thread
  for (const bool barrier : {true, false}) {
    for (int i = 0; i < kCopyThreads; ++i)
      for (int w = 0; w < 4; ++w) rows[i][w] = kStale;
    uint32_t got[kCopyThreads][4];
    run_warps(kCopyThreads / 32, [&] {
      const int i = static_cast<int>(threadIdx.x), other_warp = 1 - i / 32;
      mma::cp_async_16(rows[i], g_src[i][0], true);
      mma::cp_async_commit();
      mma::cp_async_wait<0>();
      if (barrier) __syncthreads();
      mma::ldmatrix_x4(got[i], shared_address(rows[32 * other_warp + i % 32]));  // the other warp's 32 rows
    });
    for (int i = 0; i < kCopyThreads; ++i) {
      const int other_warp = 1 - i / 32, lane = i % 32;
      for (int m = 0; m < 4; ++m) {  // register m: row 8m + lane/4 of the other warp, word lane % 4
        const uint32_t copied = g_src[32 * other_warp + 8 * m + lane / 4][0][lane % 4];
        CHECK(got[i][m] == (barrier || i >= 32 ? copied : kStale));
      }
    }
  }
}

// ---- (e) what aborts ----------------------------------------------------------------------------------

/// Runs `body` as one warp in a forked child (fail() aborts the process) and returns whether the
/// child died of SIGABRT with a message containing `expected` on stderr.
bool aborts_with(const char* expected, const std::function<void()>& body) {
  int fds[2];
  if (pipe(fds) != 0) return false;
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  if (pid < 0) return false;
  if (pid == 0) {
    const rlimit no_core{0, 0};
    setrlimit(RLIMIT_CORE, &no_core);  // an expected abort leaves no core file
    dup2(fds[1], 2);
    close(fds[0]);
    run_warps(1, body);
    _exit(0);
  }
  close(fds[1]);
  std::string err;
  char buf[256];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) err.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  const bool ok = WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT && err.find(expected) != std::string::npos;
  if (!ok) {
    std::fprintf(stderr, "expected an abort with \"%s\"; status %d, stderr: %s\n", expected, status, err.c_str());
  }
  return ok;
}

void test_aborts() {
  auto* bytes = g_smem;
  CHECK(aborts_with("ldmatrix: a row address is not 16-byte aligned", [&] {
    uint32_t r[4];
    mma::ldmatrix_x4(r, shared_address(bytes + 16 * threadIdx.x) + (threadIdx.x == 5 ? 2 : 0));
  }));
  CHECK(aborts_with("cp_async_16: an address is not 16-byte aligned", [&] {
    mma::cp_async_16(bytes + 16 * threadIdx.x + 8, g_src[threadIdx.x][0], true);
  }));
  CHECK(aborts_with("cp_async_16: an address is not 16-byte aligned", [&] {
    mma::cp_async_16(bytes + 16 * threadIdx.x, &g_src[threadIdx.x][0][1], false);
  }));
  CHECK(aborts_with("shared_address: a pointer not into shared memory", [&] { shared_address(g_src[0][0]); }));
  CHECK(aborts_with("ldmatrix: a row is outside shared memory", [&] {
    uint32_t r[4];
    mma::ldmatrix_x4(r, 16 * threadIdx.x);  // plain offsets instead of shared-window addresses
  }));
  CHECK(aborts_with("cp_async_16: a destination outside shared memory", [&] {
    mma::cp_async_16(g_src[threadIdx.x][1], g_src[threadIdx.x][0], true);
  }));
  CHECK(aborts_with("cp.async copies not waited for", [&] {
    mma::cp_async_16(bytes + 16 * threadIdx.x, g_src[threadIdx.x][0], true);
    mma::cp_async_commit();
  }));
  CHECK(aborts_with("did not all execute the same ldmatrix", [&] {
    uint32_t r4[4], r2[2];
    if (threadIdx.x < 16) {
      mma::ldmatrix_x4(r4, shared_address(bytes + 16 * threadIdx.x));
    } else {
      mma::ldmatrix_x2(r2, shared_address(bytes + 16 * threadIdx.x));
    }
  }));
  CHECK(aborts_with("did not all execute the same mma", [&] {
    MmaA a{};
    MmaB b{};
    MmaC c{};
    if (threadIdx.x % 2 == 0) {
      mma::mma_m16n8k16<__half>(c, a, b);
    } else {
      mma::mma_m16n8k16<__nv_bfloat16>(c, a, b);
    }
  }));
}

}  // namespace

int main() {
  test_ldmatrix_layouts();
  test_product<__half>("fp16", 1);
  test_product<__nv_bfloat16>("bf16", 2);
  test_pack_pair();
  test_cp_async();
  test_cp_async_needs_barrier();
  test_aborts();
  if (attn_ext_tests::g_failures != 0) {
    std::fprintf(stderr, "attn_ext_cuda_mma_sm80_emulation_tests: %d failure(s)\n", attn_ext_tests::g_failures);
    return 1;
  }
  std::printf("attn_ext_cuda_mma_sm80_emulation_tests: all checks passed\n");
  return 0;
}
