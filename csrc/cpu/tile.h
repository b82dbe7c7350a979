// Helpers that hand the CPU kernels contiguous accumulation-dtype tiles of strided inputs.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>

namespace attn_ext::cpu {

/// `n` elements left uninitialised, for per-thread tile buffers whose users write every element before
/// reading it (GEMMs with beta = 0, explicit fills, the row conversions). Zeroing the tens of kilobytes
/// of a call's buffers, as std::vector does, was a measurable part of a call at Neural Process sizes
/// (a few percent of 60 µs).
template <typename T>
class ScratchBuffer {
 public:
  explicit ScratchBuffer(int64_t n) : data_(n > 0 ? new T[n] : nullptr) {}
  T* data() { return data_.get(); }
  T* begin() { return data_.get(); }
  T& operator[](int64_t i) { return data_[i]; }
  const T& operator[](int64_t i) const { return data_[i]; }

 private:
  std::unique_ptr<T[]> data_;
};

/// Rows [0, rows) × cols of a row-major matrix at `base` with `row_stride`, as acc_t with leading
/// dimension `*ld`. Inputs already in acc_t whose rows lie back to back (or a single row) are used in place;
/// everything else (fp16/bf16, broadcast rows, and rows spread apart: one head of a [B, S, H, D] tensor, a paged
/// cache's rows) is converted or packed into `scratch` (rows·cols elements). Packing spread rows beat reading them
/// in place: decoding one query over 4 × 32,768 keys of 8 heads, D = 128, fp32, with K and V [B, S, H, D] views,
/// 76–90 ms packed against 94 in place (70 with contiguous rows), and the paged cache's chunks inside one block
/// 79 ms against 93 (AMD EPYC, 2 threads).
template <typename acc_t, typename scalar_t>
const acc_t* rows_as_acc(const scalar_t* base, int64_t row_stride, int64_t rows, int64_t cols,
                         acc_t* scratch, int64_t* ld) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    if (row_stride == cols || rows == 1) {
      *ld = std::max<int64_t>(row_stride, cols);
      return base;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      std::copy(base + r * row_stride, base + r * row_stride + cols, scratch + r * cols);
    } else {
      for (int64_t c = 0; c < cols; ++c) scratch[r * cols + c] = static_cast<acc_t>(base[r * row_stride + c]);
    }
  }
  *ld = cols;
  return scratch;
}

/// Below this many multiply-adds (~40 µs on one core) a call costs less than waking the other
/// OpenMP threads can (milliseconds when the machine is oversubscribed; measured: a 16-key state
/// update took 4-20 ms threaded on a loaded machine, 0.2 ms on one thread): run it on one thread.
constexpr int64_t kMinThreadedMacs = int64_t(1) << 22;

/// at::parallel_for grain size for `units` work units that do `total_macs` multiply-adds together.
inline int64_t grain_size_for(int64_t units, int64_t total_macs) {
  return total_macs < kMinThreadedMacs ? std::max<int64_t>(units, 1) : 1;
}

/// Number of parts the keys of each work unit are split into so that both cores have work when the
/// (batch, head, query tile) units alone are too few (e.g. one query row over a long context).
/// Depends only on the sizes and the thread count, so results are reproducible run to run.
inline int64_t key_splits_for(int64_t units, int64_t key_chunks, int64_t total_macs) {
  const int64_t threads = at::get_num_threads();
  if (units >= 2 * threads || key_chunks <= 1 || total_macs < kMinThreadedMacs) return 1;
  const int64_t wanted = (2 * threads + units - 1) / units;
  return std::min<int64_t>(wanted, key_chunks);
}

/// The chunks [first, last) of split `split` out of `splits` over `chunks` chunks.
inline void split_range(int64_t chunks, int64_t splits, int64_t split, int64_t* first, int64_t* last) {
  *first = chunks * split / splits;
  *last = chunks * (split + 1) / splits;
}

}  // namespace attn_ext::cpu
