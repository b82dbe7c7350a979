// Runs the CUDA batched Cholesky kernels' source on the host (cuda_emulation/) against a naive
// double-precision Cholesky and solve: strided inputs, n from 1 to 128, a diagonal shift, a
// non-positive-definite matrix (info = j + 1, columns ≥ j zeroed), NaN, and solves with more
// right-hand sides than one block has threads, in place and with B = I.
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "batched_cholesky_kernel.cuh"
#include "check.h"
#include "emulator_extras_tree.h"
#include "reference_linalg.h"

namespace {

using namespace attn_ext::cuda;
using attn_ext::ScalarType;
using attn_ext_tests::reference_cholesky;

template <typename T>
ScalarType scalar() {
  return sizeof(T) == 8 ? ScalarType::kFloat64 : ScalarType::kFloat32;
}

/// sm_90's opt-in shared memory per block, the default device of the cases.
constexpr std::size_t kSm90 = 232448;

/// Emulates `kernel` over the plan's grid on a device with `smem_limit` bytes of shared memory.
template <typename Kernel>
void emulate(const CholeskyLaunchPlan& plan, std::size_t smem_limit, Kernel kernel) {
  CHECK(plan.supported && plan.shared_memory_bytes <= smem_limit);
  if (!plan.supported || plan.empty) return;
  CHECK(cuda_emu::run_grid(dim3(plan.grid.x, plan.grid.y), dim3(plan.block.x), detail::smem_raw, sizeof(detail::smem_raw),
                           plan.shared_memory_bytes, kernel));
}

/// The factorisation with the instantiation the plan picks (padded rows, or unpadded for fp32).
template <typename T>
void run_factor(const BatchedCholeskyParams& p, std::size_t smem_limit = kSm90) {
  const CholeskyLaunchPlan plan = plan_batched_cholesky(p.batch, p.n, -1, p.dtype, smem_limit);
  if (plan.padded_rows) return emulate(plan, smem_limit, [&] { detail::batched_cholesky_kernel<T, true>(p); });
  CHECK(sizeof(T) == 4);  // only fp32 compiles unpadded rows
  emulate(plan, smem_limit, [&] { detail::batched_cholesky_kernel<float, false>(p); });
}

template <typename T>
void run_solve(const BatchedCholeskySolveParams& p, std::size_t smem_limit = kSm90) {
  const CholeskyLaunchPlan plan = plan_batched_cholesky(p.batch, p.n, p.r, p.dtype, smem_limit);
  if (plan.padded_rows) return emulate(plan, smem_limit, [&] { detail::batched_cholesky_solve_kernel<T, true>(p); });
  CHECK(sizeof(T) == 4);  // only fp32 compiles unpadded rows
  emulate(plan, smem_limit, [&] { detail::batched_cholesky_solve_kernel<float, false>(p); });
}

/// `batch` random SPD matrices of order n stored transposed with a padded row (strides (n+1)·n, 1,
/// n + 1 ... i.e. element (i, j) at j·(n + 1) + i), NaN in the upper triangle the kernel must not read.
template <typename T>
void factor_and_solve_case(int batch, int n, int r, uint32_t seed, double tol, std::size_t smem_limit = kSm90) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> normal;
  const int64_t ld = n + 1, mat = n * ld;
  std::vector<double> a_ref(static_cast<size_t>(batch) * n * n);
  std::vector<T> a(static_cast<size_t>(batch) * mat, std::numeric_limits<T>::quiet_NaN());
  std::vector<T> shift(batch);
  for (int m = 0; m < batch; ++m) {
    std::vector<double> x(static_cast<size_t>(n) * (n + 2));
    for (double& e : x) e = normal(gen);
    shift[m] = static_cast<T>(0.25 * (m + 1));
    for (int i = 0; i < n; ++i)
      for (int j = 0; j <= i; ++j) {
        double s = 0;
        for (int k = 0; k < n + 2; ++k) s += x[i * (n + 2) + k] * x[j * (n + 2) + k];
        a[m * mat + j * ld + i] = static_cast<T>(s);  // transposed storage: (i, j) at j·ld + i
        a_ref[(m * n + i) * n + j] = a_ref[(m * n + j) * n + i] = double(static_cast<T>(s)) + (i == j ? double(shift[m]) : 0);
      }
  }
  std::vector<T> l(static_cast<size_t>(batch) * n * n, T(7));
  std::vector<int32_t> info(batch, -5);
  BatchedCholeskyParams p;
  p.a.data = a.data(), p.a.stride_batch = mat, p.a.stride_row = 1, p.a.stride_col = ld;
  p.diag_shift = shift.data(), p.l = l.data(), p.info = info.data(), p.batch = batch, p.n = n, p.dtype = scalar<T>();
  run_factor<T>(p, smem_limit);

  std::vector<double> rhs(static_cast<size_t>(n) * r), want;
  std::vector<T> b(static_cast<size_t>(batch) * n * r), x(b.size());
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<T>(normal(gen));
  BatchedCholeskySolveParams s;
  s.l.data = l.data(), s.l.stride_batch = n * n, s.l.stride_row = n, s.l.stride_col = 1;
  s.b.data = b.data(), s.b.stride_batch = n * r, s.b.stride_row = r, s.b.stride_col = 1;
  s.x = x.data(), s.batch = batch, s.n = n, s.r = r, s.dtype = scalar<T>();
  run_solve<T>(s, smem_limit);
  std::vector<T> inv(static_cast<size_t>(batch) * n * n);
  BatchedCholeskySolveParams si = s;  // B = I: the inverse
  si.b.data = nullptr, si.x = inv.data(), si.r = n;
  run_solve<T>(si, smem_limit);

  int bad = 0;
  for (int m = 0; m < batch; ++m) {
    CHECK(info[m] == 0);
    std::vector<double> lr(a_ref.begin() + m * n * n, a_ref.begin() + (m + 1) * n * n);
    CHECK(reference_cholesky(lr.data(), n) == 0);
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) {
        const double want_l = j <= i ? lr[i * n + j] : 0.0;
        if (!(std::fabs(double(l[(m * n + i) * n + j]) - want_l) <= tol * (1 + std::fabs(want_l)))) ++bad;
      }
    for (int i = 0; i < n * r; ++i) rhs[i] = double(b[m * n * r + i]);
    want = attn_ext_tests::reference_solve(a_ref.data() + m * n * n, n, rhs, r);
    for (int i = 0; i < n * r; ++i) {
      if (!(std::fabs(double(x[m * n * r + i]) - want[i]) <= 50 * tol * (1 + std::fabs(want[i])))) ++bad;
    }
    // A · A⁻¹ = I checks the identity right-hand side.
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) {
        double e = 0;
        for (int k = 0; k < n; ++k) e += a_ref[(m * n + i) * n + k] * double(inv[(m * n + k) * n + j]);
        if (!(std::fabs(e - (i == j ? 1.0 : 0.0)) <= 50 * tol * n)) ++bad;
      }
  }
  if (bad) std::fprintf(stderr, "factor/solve n=%d r=%d sizeof(T)=%zu: %d mismatches\n", n, r, sizeof(T), bad);
  CHECK(bad == 0);
  std::printf("  n=%-3d r=%-3d batch=%d %s, %zu B of shared memory ok=%s\n", n, r, batch, sizeof(T) == 8 ? "fp64" : "fp32",
              smem_limit, bad ? "NO" : "yes");
}

/// A matrix whose leading minor of order j + 1 is not positive definite: info = j + 1, columns < j
/// hold the factor, the rest 0; and a NaN on the diagonal of row 3.
void failure_cases() {
  const int n = 9, j = 5;
  std::vector<float> a(n * n, 0.0f);
  for (int i = 0; i < n; ++i) a[i * n + i] = 4.0f;
  for (int i = 1; i < n; ++i) a[i * n + i - 1] = 1.0f;
  a[j * n + j] = -1.0f;
  std::vector<float> nan_a = a;
  nan_a[3 * n + 3] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> both(2 * n * n);
  std::copy(a.begin(), a.end(), both.begin());
  std::copy(nan_a.begin(), nan_a.end(), both.begin() + n * n);
  std::vector<float> l(2 * n * n, 7.0f);
  std::vector<int32_t> info(2, 0);
  BatchedCholeskyParams p;
  p.a.data = both.data(), p.a.stride_batch = n * n, p.a.stride_row = n, p.a.stride_col = 1;
  p.l = l.data(), p.info = info.data(), p.batch = 2, p.n = n;
  run_factor<float>(p);
  CHECK(info[0] == j + 1);
  CHECK(info[1] == 4);
  std::vector<double> ref(a.begin(), a.end());
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < r; ++c) ref[c * n + r] = ref[r * n + c];
  CHECK(reference_cholesky(ref.data(), n) == j + 1);
  int bad = 0;
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < n; ++c) {
      const double want = (c <= r && c < j) ? ref[r * n + c] : 0.0;
      if (!(std::fabs(l[r * n + c] - want) <= 1e-6)) ++bad;
      if (c >= 3 && l[n * n + r * n + c] != 0.0f) ++bad;
    }
  CHECK(bad == 0);
  std::printf("  non-SPD (info=%d) and NaN (info=%d) ok=%s\n", info[0], info[1], bad ? "NO" : "yes");
}

void plan_cases() {
  CHECK(!plan_batched_cholesky(4, 129, -1, ScalarType::kFloat32, kSm90).supported);
  const CholeskyLaunchPlan f = plan_batched_cholesky(10, 128, -1, ScalarType::kFloat64, kSm90);
  CHECK(f.supported && f.grid.x == 10 && f.grid.y == 1 && f.block.x == 128 && f.shared_memory_bytes == 128 * 129 * 8);
  CHECK(f.padded_rows);
  const CholeskyLaunchPlan s = plan_batched_cholesky(3, 40, 300, ScalarType::kFloat32, kSm90);
  CHECK(s.supported && s.grid.x == 3 && s.grid.y == 3 && s.shared_memory_bytes == 40 * 41 * 4);
  CHECK(plan_batched_cholesky(0, 40, 3, ScalarType::kFloat32, kSm90).empty);
  CHECK(plan_batched_cholesky(5, 40, 0, ScalarType::kFloat32, kSm90).empty);
  // Smaller devices: fp32 n = 128 drops the row padding on sm_75; fp64 n = 128 fits neither sm_86
  // nor sm_75, and says so.
  const CholeskyLaunchPlan t4 = plan_batched_cholesky(2, 128, -1, ScalarType::kFloat32, 65536);
  CHECK(t4.supported && !t4.padded_rows && t4.shared_memory_bytes == 65536);
  CHECK(plan_batched_cholesky(2, 127, -1, ScalarType::kFloat32, 65536).padded_rows);
  const CholeskyLaunchPlan big = plan_batched_cholesky(2, 128, 5, ScalarType::kFloat64, 101376);
  CHECK(!big.supported && big.smem.kernel != nullptr && big.smem.needed_bytes == 128 * 129 * 8 &&
        big.smem.limit_bytes == 101376);
  CHECK(plan_batched_cholesky(2, 112, 5, ScalarType::kFloat64, 101376).supported);
}

}  // namespace

int main() {
  plan_cases();
  factor_and_solve_case<float>(3, 1, 2, 1, 1e-5);
  factor_and_solve_case<float>(2, 40, 3, 2, 2e-5);
  factor_and_solve_case<double>(2, 59, 130, 3, 1e-12);
  factor_and_solve_case<float>(1, 128, 5, 4, 5e-5);
  factor_and_solve_case<float>(2, 128, 130, 5, 5e-5, 65536);  // sm_75: unpadded rows
  failure_cases();
  if (attn_ext_tests::g_failures != 0) {
    std::fprintf(stderr, "attn_ext_cuda_cholesky_emulation_tests: %d failure(s)\n", attn_ext_tests::g_failures);
    return 1;
  }
  std::printf("attn_ext_cuda_cholesky_emulation_tests: all cases passed\n");
  return 0;
}
