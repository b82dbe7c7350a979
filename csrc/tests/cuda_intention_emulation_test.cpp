// Runs the CUDA Intention forward and backward chains (csrc/cuda/intention_plan.h, i.e. the same
// steps intention.cu launches) on the host through the emulator, against a double-precision
// reference of docs/spec.md §4: masks (a fully padded batch too, where α alone makes A definite), D = 40 /
// Dv = 59 (tile tails), N = 1, N = 0 (null key pointers, as torch's empty tensors have), v = None (C = I),
// strided and broadcast inputs (k over the batch; q over batch and head, as intention_map's identity
// queries), fp32 and fp16.
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "batched_cholesky_kernel.cuh"
#include "check.h"
#include "emulator_extras_tree.h"
#include "intention_kernel.cuh"
#include "intention_plan.h"
#include "reference_linalg.h"
#include "small_gemm_kernel.cuh"

namespace {

using namespace attn_ext::cuda;
using attn_ext::ScalarType;
namespace det = attn_ext::cuda::detail;

/// sm_90's opt-in shared memory per block, the default device of the cases.
constexpr std::size_t kSm90 = 232448;

template <typename F>
void emulate(LaunchDims grid, LaunchDims block, size_t smem, F call) {
  CHECK(cuda_emu::run_grid(dim3(grid.x, grid.y, grid.z), dim3(block.x), det::smem_raw, sizeof(det::smem_raw), smem,
                           call));
}

template <typename TA, typename TB, typename TC>
void gemm_step(const SmallGemmParams& g, std::size_t smem_limit) {
  const SmallGemmLaunchPlan plan = plan_small_gemm(g.batch * g.heads, g.rows, g.cols, smem_limit);
  CHECK(plan.supported);
  if (!plan.empty) emulate(plan.grid, plan.block, plan.shared_memory_bytes, [&] { det::small_gemm_kernel<TA, TB, TC>(g); });
}

/// Emulates a Cholesky step (call(std::bool_constant<padded rows>{}) runs its kernel) with the
/// instantiation of the plan's row padding, as batched_cholesky.cu picks it.
template <typename Call>
void cholesky_step(const CholeskyLaunchPlan& cp, std::size_t smem_limit, Call call) {
  CHECK(cp.supported && cp.shared_memory_bytes <= smem_limit);
  if (!cp.supported || cp.empty) return;
  if (cp.padded_rows) {
    emulate(cp.grid, cp.block, cp.shared_memory_bytes, [&] { call(std::true_type{}); });
  } else {
    emulate(cp.grid, cp.block, cp.shared_memory_bytes, [&] { call(std::false_type{}); });
  }
}

/// The emulated counterpart of intention.cu's run_step, on a device with `smem_limit` bytes of shared
/// memory per block (the Cholesky steps take the plan's row padding, as batched_cholesky.cu does).
template <typename S>
void run_plan(const IntentionPlan& plan, std::size_t smem_limit) {
  CHECK(plan.supported);
  for (int i = 0; i < plan.count; ++i) {
    const IntentionStep& st = plan.steps[i];
    switch (st.kind) {
      case IntentionStep::kGemmSSF: gemm_step<S, S, float>(st.gemm, smem_limit); break;
      case IntentionStep::kGemmSFS: gemm_step<S, float, S>(st.gemm, smem_limit); break;
      case IntentionStep::kGemmFFF: gemm_step<float, float, float>(st.gemm, smem_limit); break;
      case IntentionStep::kCholesky: {
        const BatchedCholeskyParams& f = st.cholesky;
        cholesky_step(plan_batched_cholesky(f.batch, f.n, -1, f.dtype, smem_limit), smem_limit,
                      [&](auto padded) { det::batched_cholesky_kernel<float, decltype(padded)::value>(f); });
        break;
      }
      case IntentionStep::kSolve: {
        const BatchedCholeskySolveParams& sv = st.solve;
        cholesky_step(plan_batched_cholesky(sv.batch, sv.n, sv.r, sv.dtype, smem_limit), smem_limit,
                      [&](auto padded) { det::batched_cholesky_solve_kernel<float, decltype(padded)::value>(sv); });
        break;
      }
      case IntentionStep::kNegatedDot: {
        LaunchDims grid, block;
        grid.x = static_cast<unsigned int>(st.dot.batch), block.x = kNegatedDotThreads;
        emulate(grid, block, det::kNegatedDotSmemBytes, [&] { det::negated_dot_kernel(st.dot); });
        break;
      }
    }
  }
}

float to_f(float x) { return x; }
float to_f(__half x) { return __half2float(x); }
template <typename S> S from_f(float x);
template <> float from_f<float>(float x) { return x; }
template <> __half from_f<__half>(float x) { return __float2half_rn(x); }

struct Case {
  const char* name;
  int64_t B, H, M, N, D, Dv;
  bool mask, has_v, broadcast_k;
  double tol;
  std::size_t smem_limit = kSm90;  ///< the device's opt-in shared memory per block
  bool broadcast_q = false;        ///< q with batch and head strides 0 (intention_map's identity queries)
};

int g_bad = 0;
void compare(const Case& c, const char* what, double got, double want, double scale_of) {
  if (!(std::fabs(got - want) <= c.tol * (1 + scale_of))) {
    if (++g_bad <= 10) std::fprintf(stderr, "[%s] %s: got %.8g want %.8g\n", c.name, what, got, want);
  }
}

template <typename S>
void run_case(const Case& c, uint32_t seed) {
  const int64_t B = c.B, H = c.H, M = c.M, N = c.N, D = c.D, Dv = c.has_v ? c.Dv : c.D;
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // q as [B, M, H, D + 2] (transposed heads, padded rows), k [B or 1, H, N, D + 1], v [B, H, N, Dv];
  // padding (and padded keys' rows) hold NaN.
  const int64_t kb = c.broadcast_k ? 1 : B;
  std::vector<S> q(B * M * H * (D + 2), from_f<S>(nan)), k(kb * H * N * (D + 1) + 1, from_f<S>(nan)),
      v(B * H * N * Dv + 1, from_f<S>(nan)), go(B * H * M * Dv);
  std::vector<uint8_t> mask(B * (N + 3), 0);
  std::bernoulli_distribution padded(0.3);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = 0; n < N; ++n) mask[b * (N + 3) + n] = c.mask && (b == B - 1 || padded(gen));
  IntentionFwdParams fwd;
  IntentionInputs& p = fwd.in;
  p.B = B, p.H = H, p.M = M, p.N = N, p.D = D, p.Dv = Dv;
  p.q_stride_b = c.broadcast_q ? 0 : M * H * (D + 2), p.q_stride_h = c.broadcast_q ? 0 : D + 2;
  p.q_stride_m = H * (D + 2);
  p.k_stride_b = c.broadcast_k ? 0 : H * N * (D + 1), p.k_stride_h = N * (D + 1), p.k_stride_n = D + 1;
  p.v_stride_b = H * N * Dv, p.v_stride_h = N * Dv, p.v_stride_n = Dv;
  auto qi = [&](int64_t b, int64_t h, int64_t m, int64_t d) { return b * p.q_stride_b + h * p.q_stride_h + m * p.q_stride_m + d; };
  auto ki = [&](int64_t b, int64_t h, int64_t n, int64_t d) { return b * p.k_stride_b + h * p.k_stride_h + n * p.k_stride_n + d; };
  auto vi = [&](int64_t b, int64_t h, int64_t n, int64_t d) { return b * p.v_stride_b + h * p.v_stride_h + n * p.v_stride_n + d; };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t m = 0; m < M; ++m)
        for (int64_t d = 0; d < D; ++d) q[qi(b, h, m, d)] = from_f<S>(normal(gen));
      for (int64_t n = 0; n < N; ++n) {
        const bool pad = mask[b * (N + 3) + n] && !c.broadcast_k;
        for (int64_t d = 0; d < D; ++d) k[ki(b, h, n, d)] = from_f<S>(pad ? nan : normal(gen));
        for (int64_t d = 0; d < Dv; ++d) v[vi(b, h, n, d)] = from_f<S>(mask[b * (N + 3) + n] ? nan : normal(gen));
      }
    }
  for (S& x : go) x = from_f<S>(normal(gen));
  std::vector<float> alpha(B * H);
  for (int64_t i = 0; i < B * H; ++i) alpha[i] = 0.5f + 0.25f * static_cast<float>(i);
  const int64_t E = D + (c.has_v ? Dv : 0);
  std::vector<S> out(B * H * M * Dv);
  std::vector<float> factor(B * H * D * D), weights(B * H * D * Dv), stats(B * H * D * E);
  std::vector<int32_t> info(B * H, -1);
  // With N = 0 the pointers are null, as an empty torch tensor's are: has_values, not v, says C = KᵀV.
  p.q = q.data(), p.k = N > 0 ? k.data() : nullptr, p.v = c.has_v && N > 0 ? v.data() : nullptr;
  p.has_values = c.has_v;
  p.key_padding_mask = c.mask ? mask.data() : nullptr, p.mask_stride_b = N + 3;
  p.scale = 0.7f, p.dtype = sizeof(S) == 4 ? ScalarType::kFloat32 : ScalarType::kFloat16;
  fwd.alpha = alpha.data(), fwd.out = out.data(), fwd.factor = factor.data(), fwd.weights = weights.data();
  fwd.stats = stats.data(), fwd.info = info.data();
  run_plan<S>(plan_intention_fwd(fwd, c.smem_limit), c.smem_limit);

  IntentionBwdParams g;
  g.in = p;  // the same inputs
  g.grad_out = go.data(), g.factor = factor.data(), g.weights = weights.data();
  std::vector<S> dq(B * H * M * D), dk(B * H * N * D, from_f<S>(nan)), dv(B * H * N * Dv, from_f<S>(nan));
  std::vector<float> dalpha(B * H), db(B * H * D * Dv), e(B * H * D * D);
  g.grad_q = dq.data(), g.grad_k = N > 0 ? dk.data() : nullptr, g.grad_v = c.has_v && N > 0 ? dv.data() : nullptr;
  g.grad_alpha = dalpha.data();
  g.db = db.data(), g.e = e.data();
  run_plan<S>(plan_intention_bwd(g, c.smem_limit), c.smem_limit);

  // Reference in double, per (b, h), from the stored inputs.
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t bh = b * H + h;
      CHECK(info[bh] == 0);
      auto valid = [&](int64_t n) { return !(c.mask && mask[b * (N + 3) + n]); };
      auto K = [&](int64_t n, int64_t d) { return double(to_f(k[ki(b, h, n, d)])); };
      auto V = [&](int64_t n, int64_t d) { return c.has_v ? double(to_f(v[vi(b, h, n, d)])) : double(n == d); };
      std::vector<double> A(D * D, 0.0), C(D * Dv, 0.0);
      for (int64_t n = 0; n < N; ++n) {
        if (!valid(n)) continue;
        for (int64_t i = 0; i < D; ++i) {
          for (int64_t j = 0; j < D; ++j) A[i * D + j] += K(n, i) * K(n, j);
          if (c.has_v) for (int64_t j = 0; j < Dv; ++j) C[i * Dv + j] += K(n, i) * V(n, j);
        }
      }
      for (int64_t i = 0; i < D; ++i) {
        A[i * D + i] += alpha[bh];
        if (!c.has_v) C[i * Dv + i] = 1.0;
      }
      std::vector<double> L(A);
      attn_ext_tests::reference_cholesky(L.data(), static_cast<int>(D));
      for (int64_t i = 0; i < D; ++i)
        for (int64_t j = 0; j < D; ++j) compare(c, "factor", factor[bh * D * D + i * D + j], j <= i ? L[i * D + j] : 0.0, std::fabs(L[i * D + i]));
      const std::vector<double> W = attn_ext_tests::reference_solve(A.data(), static_cast<int>(D), C, static_cast<int>(Dv));
      double wmax = 0;
      for (double x : W) wmax = std::fmax(wmax, std::fabs(x));
      for (int64_t i = 0; i < D * Dv; ++i) compare(c, "weights", weights[bh * D * Dv + i], W[i], wmax);
      std::vector<double> R(D * Dv, 0.0);
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t j = 0; j < Dv; ++j) {
          double o = 0;
          for (int64_t d = 0; d < D; ++d) o += double(to_f(q[qi(b, h, m, d)])) * W[d * Dv + j];
          compare(c, "out", to_f(out[(bh * M + m) * Dv + j]), p.scale * o, std::fabs(o));
        }
        for (int64_t d = 0; d < D; ++d) {
          double s = 0;
          for (int64_t j = 0; j < Dv; ++j) {
            s += double(to_f(go[(bh * M + m) * Dv + j])) * W[d * Dv + j];
            R[d * Dv + j] += p.scale * double(to_f(q[qi(b, h, m, d)])) * to_f(go[(bh * M + m) * Dv + j]);
          }
          compare(c, "grad_q", to_f(dq[(bh * M + m) * D + d]), p.scale * s, std::fabs(s));
        }
      }
      const std::vector<double> dB = attn_ext_tests::reference_solve(A.data(), static_cast<int>(D), R, static_cast<int>(Dv));
      double da = 0;
      for (int64_t i = 0; i < D * Dv; ++i) da -= dB[i] * W[i];
      compare(c, "grad_alpha", dalpha[bh], da, std::fabs(da));
      for (int64_t n = 0; n < N; ++n)
        for (int64_t i = 0; i < D; ++i) {
          double gk = 0;
          if (valid(n)) {
            for (int64_t j = 0; j < D; ++j) {
              double eij = 0;
              for (int64_t t = 0; t < Dv; ++t) eij += dB[i * Dv + t] * W[j * Dv + t] + W[i * Dv + t] * dB[j * Dv + t];
              gk -= K(n, j) * eij;
            }
            if (c.has_v) for (int64_t t = 0; t < Dv; ++t) gk += V(n, t) * dB[i * Dv + t];
          }
          compare(c, "grad_k", to_f(dk[(bh * N + n) * D + i]), gk, std::fabs(gk));
        }
      if (c.has_v)
        for (int64_t n = 0; n < N; ++n)
          for (int64_t t = 0; t < Dv; ++t) {
            double gv = 0;
            if (valid(n)) for (int64_t d = 0; d < D; ++d) gv += K(n, d) * dB[d * Dv + t];
            compare(c, "grad_v", to_f(dv[(bh * N + n) * Dv + t]), gv, std::fabs(gv));
          }
    }
  std::printf("  %-40s ok=%s\n", c.name, g_bad == 0 ? "yes" : "NO");
  CHECK(g_bad == 0);
  g_bad = 0;
}

/// The launch plans in plain C++: GEMM geometry and the shape of the Intention chains.
void plan_cases() {
  const SmallGemmLaunchPlan g = plan_small_gemm(6, 70, 33, kSm90);
  CHECK(g.supported && g.row_tiles == 3 && g.grid.x == 18 && g.grid.y == 2 && g.block.x == 256);
  CHECK(g.shared_memory_bytes == 2 * 4 * 32 * 33);
  CHECK(plan_small_gemm(4, 0, 5, kSm90).empty && plan_small_gemm(0, 3, 5, kSm90).empty);
  CHECK(!plan_small_gemm(1, 10, 32LL * 65536, kSm90).supported);
  IntentionFwdParams f;
  f.in.B = 2, f.in.H = 3, f.in.M = 5, f.in.N = 7, f.in.D = 40, f.in.Dv = 59;
  int k = 0;
  f.in.k = &k, f.in.v = &k, f.in.has_values = true;
  IntentionPlan plan = plan_intention_fwd(f, kSm90);
  CHECK(plan.supported && plan.count == 5 && plan.steps[2].kind == IntentionStep::kCholesky);
  CHECK(plan.steps[0].gemm.c_stride_row == 99 && plan.steps[1].gemm.cols == 59);
  f.in.v = nullptr, f.in.has_values = false;
  CHECK(!plan_intention_fwd(f, kSm90).supported);  // without v, Dv must be D
  f.in.Dv = 40;
  plan = plan_intention_fwd(f, kSm90);
  CHECK(plan.supported && plan.count == 4 && plan.steps[2].solve.b.data == nullptr && plan.steps[2].solve.r == 40);
  f.in.D = f.in.Dv = 129;
  CHECK(!plan_intention_fwd(f, kSm90).supported);  // the factor must fit one block
  f.in.D = f.in.Dv = 128;
  CHECK(plan_intention_fwd(f, 65536).supported);  // sm_75: unpadded rows of the factor
  plan = plan_intention_fwd(f, 40000);            // no such device: every step is checked
  CHECK(!plan.supported && plan.smem.kernel != nullptr && plan.smem.needed_bytes == 128 * 128 * 4 &&
        plan.smem.limit_bytes == 40000);
  IntentionBwdParams b;
  b.in = f.in, b.in.D = b.in.Dv = 16, b.in.v = &k, b.in.has_values = true;
  plan = plan_intention_bwd(b, kSm90);
  CHECK(plan.supported && plan.count == 7 && plan.steps[3].kind == IntentionStep::kNegatedDot);
  b.in.v = nullptr, b.in.has_values = false;
  CHECK(plan_intention_bwd(b, kSm90).count == 6 && plan_intention_bwd(b, kSm90).steps[5].gemm.a2.data == nullptr);
}

}  // namespace

int main() {
  plan_cases();
  // name, B, H, M, N, D, Dv, mask, has_v, broadcast_k, tol
  run_case<float>({"fp32 D=40 Dv=59 masked (last batch all padding)", 3, 2, 37, 70, 40, 59, true, true, false, 2e-4}, 1);
  run_case<float>({"fp32 N=1 D=40 Dv=59", 1, 2, 5, 1, 40, 59, false, true, false, 2e-4}, 2);
  run_case<float>({"fp32 v=None (C = I) masked broadcast k", 2, 1, 33, 45, 40, 40, true, false, true, 2e-4}, 3);
  run_case<float>({"fp32 D=1 Dv=3 M=0", 1, 1, 0, 4, 1, 3, false, true, false, 2e-4}, 4);
  run_case<float>({"fp32 N=0 (no keys: out = 0, W = 0)", 1, 2, 3, 0, 5, 3, false, true, false, 2e-4}, 7);
  run_case<float>({"fp32 N=0 v=None (W = I/alpha)", 1, 2, 3, 0, 5, 5, false, false, false, 2e-4}, 8);
  run_case<float>({"fp32 broadcast q (identity queries)", 2, 3, 6, 30, 6, 4, true, true, false, 2e-4, kSm90, true}, 9);
  run_case<__half>({"fp16 D=24 Dv=16 masked", 2, 2, 20, 50, 24, 16, true, true, false, 2e-2}, 5);
  // sm_75's 64 KiB: the factor of D = 128 takes the unpadded rows (batched_cholesky_plan.h).
  run_case<float>({"fp32 D=128 Dv=8, 64 KiB: unpadded factor", 1, 1, 6, 150, 128, 8, false, true, false, 2e-3, 65536}, 6);
  if (attn_ext_tests::g_failures != 0) {
    std::fprintf(stderr, "attn_ext_cuda_intention_emulation_tests: %d failure(s)\n", attn_ext_tests::g_failures);
    return 1;
  }
  std::printf("attn_ext_cuda_intention_emulation_tests: all cases passed\n");
  return 0;
}
