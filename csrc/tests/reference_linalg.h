// Naive double-precision Cholesky and SPD solve: the references of the CUDA emulation tests.
#pragma once

#include <cmath>
#include <vector>

namespace attn_ext_tests {

/// In place on the full symmetric n×n row-major `a`: its lower triangle becomes L (upper untouched).
/// Returns 0, or j + 1 for the first column whose pivot is not positive.
inline int reference_cholesky(double* a, int n) {
  for (int j = 0; j < n; ++j) {
    double pivot = a[j * n + j];
    for (int k = 0; k < j; ++k) pivot -= a[j * n + k] * a[j * n + k];
    if (!(pivot > 0.0) || !std::isfinite(pivot)) return j + 1;
    const double d = std::sqrt(pivot);
    a[j * n + j] = d;
    for (int i = j + 1; i < n; ++i) {
      double s = a[i * n + j];
      for (int k = 0; k < j; ++k) s -= a[i * n + k] * a[j * n + k];
      a[i * n + j] = s / d;
    }
  }
  return 0;
}

/// X = A⁻¹ B for the full symmetric positive definite n×n `a` and B (n×r row-major).
inline std::vector<double> reference_solve(const double* a, int n, std::vector<double> b, int r) {
  std::vector<double> l(a, a + n * n);
  reference_cholesky(l.data(), n);
  for (int c = 0; c < r; ++c) {
    for (int i = 0; i < n; ++i) {
      double s = b[i * r + c];
      for (int k = 0; k < i; ++k) s -= l[i * n + k] * b[k * r + c];
      b[i * r + c] = s / l[i * n + i];
    }
    for (int i = n - 1; i >= 0; --i) {
      double s = b[i * r + c];
      for (int k = i + 1; k < n; ++k) s -= l[k * n + i] * b[k * r + c];
      b[i * r + c] = s / l[i * n + i];
    }
  }
  return b;
}

}  // namespace attn_ext_tests
