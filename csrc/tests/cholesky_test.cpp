// Host tests of attn_ext/cholesky.h (the portable per-matrix routines) and of the CPU SIMD batch
// kernels (cpu/cholesky_simd.cpp) against them: plain C++17, no torch, no GPU.
// Exit status = number of failed checks (capped), so ctest reports any failure.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <vector>

#include "attn_ext/cholesky.h"
#include "cpu/cholesky_simd.h"

#include "tests/check.h"

namespace {

using attn_ext_tests::g_failures;

#define CHECK_LE(a, b, what)                                                                                   \
  do {                                                                                                         \
    const double va_ = (a), vb_ = (b);                                                                         \
    if (!(va_ <= vb_)) {                                                                                       \
      ++g_failures;                                                                                            \
      std::fprintf(stderr, "%s:%d: %s: %s = %.3g > %s = %.3g\n", __FILE__, __LINE__, what, #a, va_, #b, vb_); \
    }                                                                                                          \
  } while (0)

using Matrix = std::vector<double>;

/// A = Z Zᵀ / n + I: SPD with condition number of order 10.
Matrix random_spd(int n, std::mt19937& gen) {
  std::normal_distribution<double> normal;
  Matrix z(n * n), a(n * n);
  for (double& v : z) v = normal(gen);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      double s = i == j ? 1.0 : 0.0;
      for (int k = 0; k < n; ++k) s += z[i * n + k] * z[j * n + k] / n;
      a[i * n + j] = s;
    }
  }
  return a;
}

double max_abs_diff(const std::vector<double>& x, const std::vector<double>& y) {
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::fabs(x[i] - y[i]));
  return m;
}

template <typename T>
std::vector<T> cast(const Matrix& m) {
  return std::vector<T>(m.begin(), m.end());
}

Matrix to_double(const std::vector<float>& m) { return Matrix(m.begin(), m.end()); }
const Matrix& to_double(const Matrix& m) { return m; }

/// max |L Lᵀ − A| over the lower triangle, and whether L's strict upper part was left alone.
template <typename T>
double reconstruction_error(const std::vector<T>& l, const Matrix& a, int n) {
  double err = 0;
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j <= i; ++j) {
      double s = 0;
      for (int k = 0; k <= j; ++k) s += static_cast<double>(l[i * n + k]) * l[j * n + k];
      err = std::max(err, std::fabs(s - a[i * n + j]));
    }
  }
  return err;
}

void test_header_factor_and_solve() {
  std::mt19937 gen(1);
  std::normal_distribution<double> normal;
  for (int n : {1, 2, 5, 16, 33}) {
    const Matrix a = random_spd(n, gen);
    Matrix l = a;
    for (int i = 0; i < n; ++i) l[i * n + (i + 1 < n ? i + 1 : i)] = i + 1 < n ? 123.0 : l[i * n + i];
    CHECK(attn_ext::cholesky_lower_inplace(l.data(), n, n) == 0);
    for (int i = 0; i + 1 < n; ++i) CHECK(l[i * n + i + 1] == 123.0);  // upper triangle untouched
    CHECK_LE(reconstruction_error(l, a, n), 1e-12, "double L Lᵀ = A");
    std::vector<float> lf = cast<float>(a);
    CHECK(attn_ext::cholesky_lower_inplace(lf.data(), n, n) == 0);
    CHECK_LE(reconstruction_error(lf, a, n), 2e-5, "float L Lᵀ = A");
    for (int r : {1, 3}) {
      Matrix b(n * r);
      for (double& v : b) v = normal(gen);
      Matrix x = b;
      attn_ext::cholesky_solve_inplace(l.data(), n, n, x.data(), r, r);
      double resid = 0;
      for (int i = 0; i < n; ++i) {
        for (int c = 0; c < r; ++c) {
          double s = 0;
          for (int k = 0; k < n; ++k) s += a[i * n + k] * x[k * r + c];
          resid = std::max(resid, std::fabs(s - b[i * r + c]));
        }
      }
      CHECK_LE(resid, 1e-12, "A X = B");
    }
  }
}

/// A = M D Mᵀ with M unit lower triangular and D = diag(1, …, −1 at column j, …, 1): the pivots are
/// D's entries, so the factorisation must stop at column j.
Matrix indefinite_at(int n, int j, std::mt19937& gen) {
  std::uniform_real_distribution<double> uniform(-0.5, 0.5);
  Matrix m(n * n, 0.0), a(n * n, 0.0);
  for (int i = 0; i < n; ++i) {
    m[i * n + i] = 1.0;
    for (int k = 0; k < i; ++k) m[i * n + k] = uniform(gen);
  }
  for (int i = 0; i < n; ++i) {
    for (int c = 0; c < n; ++c) {
      double s = 0;
      for (int k = 0; k < n; ++k) s += m[i * n + k] * (k == j ? -1.0 : 1.0) * m[c * n + k];
      a[i * n + c] = s;
    }
  }
  return a;
}

void test_header_info() {
  std::mt19937 gen(2);
  for (int j : {0, 3, 6}) {
    Matrix a = indefinite_at(7, j, gen);
    CHECK(attn_ext::cholesky_lower_inplace(a.data(), 7, 7) == j + 1);
  }
  Matrix nan_matrix = random_spd(6, gen);
  nan_matrix[4 * 6 + 2] = std::numeric_limits<double>::quiet_NaN();
  CHECK(attn_ext::cholesky_lower_inplace(nan_matrix.data(), 6, 6) == 5);  // NaN reaches row 4's pivot
  Matrix inf_matrix = random_spd(6, gen);
  inf_matrix[0] = std::numeric_limits<double>::infinity();
  CHECK(attn_ext::cholesky_lower_inplace(inf_matrix.data(), 6, 6) == 1);
}

/// The SIMD batch kernels agree with the header routines, for sizes around the block (6 rows) and
/// vector (16 floats, 8 doubles) boundaries, on a strided (transposed) batch.
template <typename T>
void test_simd_matches_header() {
  std::mt19937 gen(3);
  std::normal_distribution<double> normal;
  const double tol = sizeof(T) == 4 ? 2e-4 : 1e-11;
  for (int n : {1, 5, 6, 7, 8, 16, 17, 40, 64, 70}) {
    const int batch = 3;
    std::vector<T> a(batch * n * n), a_t(batch * n * n), l(batch * n * n);
    std::vector<int32_t> info(batch, -1);
    for (int m = 0; m < batch; ++m) {
      const Matrix spd = random_spd(n, gen);
      for (int i = 0; i < n * n; ++i) a[m * n * n + i] = static_cast<T>(spd[i]);
      for (int i = 0; i < n; ++i)
        for (int j = 0; j < n; ++j) a_t[m * n * n + j * n + i] = a[m * n * n + i * n + j];
    }
    for (const bool transposed : {false, true}) {
      const attn_ext::cpu::BatchStrides strides{n * n, transposed ? 1 : n, transposed ? n : 1};
      attn_ext::cpu::cholesky_factor_batch((transposed ? a_t : a).data(), strides, l.data(), info.data(), n, 0, batch);
      for (int m = 0; m < batch; ++m) {
        CHECK(info[m] == 0);
        std::vector<T> expected(a.begin() + m * n * n, a.begin() + (m + 1) * n * n);
        CHECK(attn_ext::cholesky_lower_inplace(expected.data(), n, n) == 0);
        for (int i = 0; i < n; ++i)
          for (int j = i + 1; j < n; ++j) expected[i * n + j] = T(0);
        const std::vector<T> got(l.begin() + m * n * n, l.begin() + (m + 1) * n * n);
        CHECK_LE(max_abs_diff(to_double(got), to_double(expected)), tol, "SIMD factor vs header");
      }
    }
    for (int r : {1, 3, 16, 17, 32}) {
      std::vector<T> b(batch * n * r), x(batch * n * r);
      for (T& v : b) v = static_cast<T>(normal(gen));
      attn_ext::cpu::cholesky_solve_batch(l.data(), {n * n, n, 1}, b.data(), {n * r, r, 1}, x.data(), n, r, 0, batch);
      for (int m = 0; m < batch; ++m) {
        std::vector<T> expected(b.begin() + m * n * r, b.begin() + (m + 1) * n * r);
        attn_ext::cholesky_solve_inplace(l.data() + m * n * n, n, n, expected.data(), r, r);
        const std::vector<T> got(x.begin() + m * n * r, x.begin() + (m + 1) * n * r);
        CHECK_LE(max_abs_diff(to_double(got), to_double(expected)), tol * 10, "SIMD solve vs header");
      }
    }
  }
}

void test_simd_info() {
  std::mt19937 gen(4);
  for (int j : {0, 5, 6, 17, 39}) {
    const int n = 40;
    const Matrix a = indefinite_at(n, j, gen);
    std::vector<double> l(n * n, -1.0);
    int32_t info = -1;
    attn_ext::cpu::cholesky_factor_batch(a.data(), {n * n, n, 1}, l.data(), &info, n, 0, 1);
    CHECK(info == j + 1);
    for (int i = 0; i < n; ++i)
      for (int c = j; c < n; ++c) CHECK(l[i * n + c] == 0.0);  // failed columns are zeroed
  }
}

}  // namespace

int main() {
  test_header_factor_and_solve();
  test_header_info();
  // Every instruction-set path of the SIMD kernels this CPU can run (ATTN_EXT_CPU_ISA caps the level).
  for (const char* isa : {"avx512", "avx2", "baseline"}) {
    setenv("ATTN_EXT_CPU_ISA", isa, 1);
    test_simd_matches_header<float>();
    test_simd_matches_header<double>();
    test_simd_info();
  }
  unsetenv("ATTN_EXT_CPU_ISA");
  if (g_failures != 0) {
    std::fprintf(stderr, "attn_ext_cholesky_tests: %d check(s) failed\n", g_failures);
    return g_failures > 100 ? 100 : g_failures;
  }
  std::printf("attn_ext_cholesky_tests: all checks passed\n");
  return 0;
}
