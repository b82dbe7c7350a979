// Batched Cholesky factorisation and solves of small SPD matrices on the CPU (the Intention op's
// (KᵀK + αI)⁻¹ and its backward, docs/spec.md §4): input checks, batch flattening and threading here; the
// per-matrix arithmetic is in cholesky_simd.cpp.
//
// One work item is one matrix: at::parallel_for hands each thread a contiguous range of the batch,
// which cholesky_simd streams through with one scratch buffer (prefetching the next matrix).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "checks/intention_checks.h"
#include "cholesky_simd.h"
#include "ops.h"

namespace attn_ext::cpu {
namespace {

void check_on_cpu(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "attn_ext.", op, ": the CPU kernel got ", name, " on ", t.device());
}

/// The matrices of t [..., rows, cols] as a 3-D [batch, rows, cols] view (a copy only when the
/// batch dimensions cannot be merged), and the batch size.
at::Tensor as_batch_of_matrices(const at::Tensor& t, int64_t batch) {
  return t.reshape({batch, t.size(-2), t.size(-1)});
}

BatchStrides strides_of(const at::Tensor& t3) { return BatchStrides{t3.stride(0), t3.stride(1), t3.stride(2)}; }

/// Matrices per parallel_for chunk so that a chunk carries at least ~50k multiply-adds.
int64_t grain_size(int64_t macs_per_matrix) {
  constexpr int64_t kMinChunkMacs = 1 << 16;
  return std::max<int64_t>(1, kMinChunkMacs / std::max<int64_t>(macs_per_matrix, 1));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> batched_cholesky_cpu(const at::Tensor& a) {
  check_square_matrices("batched_cholesky", "A", a);
  check_cholesky_dtype("batched_cholesky", "A", a);
  check_on_cpu("batched_cholesky", "A", a);
  const int64_t n = a.size(-1);
  const std::vector<int64_t> batch_sizes(a.sizes().begin(), a.sizes().end() - 2);
  at::Tensor l = at::empty(a.sizes(), a.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor info = at::zeros(batch_sizes, a.options().dtype(at::kInt));
  const int64_t batch = info.numel();
  if (batch == 0 || n == 0) return {l, info};
  const at::Tensor a3 = as_batch_of_matrices(a, batch);
  const BatchStrides a_strides = strides_of(a3);
  int32_t* info_data = info.mutable_data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "attn_ext_batched_cholesky", [&] {
    const scalar_t* a_data = a3.const_data_ptr<scalar_t>();
    scalar_t* l_data = l.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, batch, grain_size(n * n * n / 6), [&](int64_t begin, int64_t end) {
      cholesky_factor_batch(a_data, a_strides, l_data, info_data, n, begin, end);
    });
  });
  return {l, info};
}

at::Tensor batched_cholesky_solve_cpu(const at::Tensor& l, const at::Tensor& b) {
  check_cholesky_solve_inputs("batched_cholesky_solve", "L", l, b);
  check_on_cpu("batched_cholesky_solve", "L", l);
  check_on_cpu("batched_cholesky_solve", "B", b);
  const int64_t n = l.size(-1), r = b.size(-1);
  at::Tensor x = at::empty(b.sizes(), b.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t batch = x.numel() == 0 ? 0 : x.numel() / (n * r);
  if (batch == 0) return x;
  const at::Tensor l3 = as_batch_of_matrices(l, batch);
  const at::Tensor b3 = as_batch_of_matrices(b, batch);
  const BatchStrides l_strides = strides_of(l3), b_strides = strides_of(b3);
  AT_DISPATCH_FLOATING_TYPES(l.scalar_type(), "attn_ext_batched_cholesky_solve", [&] {
    const scalar_t* l_data = l3.const_data_ptr<scalar_t>();
    const scalar_t* b_data = b3.const_data_ptr<scalar_t>();
    scalar_t* x_data = x.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, batch, grain_size(n * n * r), [&](int64_t begin, int64_t end) {
      cholesky_solve_batch(l_data, l_strides, b_data, b_strides, x_data, n, r, begin, end);
    });
  });
  return x;
}

std::tuple<at::Tensor, at::Tensor> batched_spd_solve_cpu(const at::Tensor& a, const at::Tensor& b) {
  check_cholesky_solve_inputs("batched_spd_solve", "A", a, b);
  check_on_cpu("batched_spd_solve", "A", a);
  check_on_cpu("batched_spd_solve", "B", b);
  const int64_t n = a.size(-1), r = b.size(-1);
  const std::vector<int64_t> batch_sizes(a.sizes().begin(), a.sizes().end() - 2);
  at::Tensor x = at::empty(b.sizes(), b.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor info = at::zeros(batch_sizes, a.options().dtype(at::kInt));
  const int64_t batch = info.numel();
  if (batch == 0 || n == 0 || r == 0) return {x, info};
  const at::Tensor a3 = as_batch_of_matrices(a, batch);
  const at::Tensor b3 = as_batch_of_matrices(b, batch);
  const BatchStrides a_strides = strides_of(a3), b_strides = strides_of(b3);
  int32_t* info_data = info.mutable_data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "attn_ext_batched_spd_solve", [&] {
    const scalar_t* a_data = a3.const_data_ptr<scalar_t>();
    const scalar_t* b_data = b3.const_data_ptr<scalar_t>();
    scalar_t* x_data = x.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, batch, grain_size(n * n * (n / 6 + r)), [&](int64_t begin, int64_t end) {
      cholesky_factor_solve_batch(a_data, a_strides, b_data, b_strides, x_data, info_data, n, r, begin, end);
    });
  });
  return {x, info};
}

}  // namespace attn_ext::cpu
