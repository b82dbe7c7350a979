// Host-emulation shim for <mma.h> (nvcuda::wmma, 16x16x16 shapes only); see cuda_emulator.h.
//
// On a GPU a fragment's elements are spread over the 32 lanes in an unspecified order. Here every
// emulated thread holds the whole tile in logical (row, column) order and computes the whole
// product, so kernels that use fragments only through the wmma functions (never by element
// position) behave identically; kernels that index fragment elements are not supported.
//
// Synchronisation: the functions are warp-collective on a GPU. Here store_matrix_sync yields to the
// scheduler before writing, so that every thread of the block has done its loads of the current
// round before any thread overwrites a tile it may still read (an accumulate-in-place pattern:
// load C, mma, store C). Then each lane writes only "its" elements (element e belongs to lane
// (13e + 5) mod 32: a scrambled stand-in for the hardware's unspecified distribution, so that it does
// not happen to line up with a kernel's own lane-strided loops), so a missing __syncwarp is
// caught like on a GPU: lanes that read a stored tile with plain loads before the barrier, or a
// load_matrix_sync that runs before other lanes' plain stores reached memory, see stale data in the
// elements other lanes own. Loads do not yield.
#pragma once

#include "common/dtypes.cuh"
#include "cuda_emulator.h"

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

namespace detail {
template <typename Use, int M, int N, int K>
struct tile_shape;
template <int M, int N, int K>
struct tile_shape<matrix_a, M, N, K> {
  static constexpr int rows = M, cols = K;
};
template <int M, int N, int K>
struct tile_shape<matrix_b, M, N, K> {
  static constexpr int rows = K, cols = N;
};
template <int M, int N, int K>
struct tile_shape<accumulator, M, N, K> {
  static constexpr int rows = M, cols = N;
};

// The kernels' own conversions (the shared header is plain host code under the emulator).
using attn_ext::cuda::detail::from_float;
using attn_ext::cuda::detail::to_float;

template <typename Layout>
constexpr bool is_col_major() {
  return false;
}
template <>
constexpr bool is_col_major<col_major>() {
  return true;
}
}  // namespace detail

/// The whole tile, row-major in logical coordinates, as fp32 (exact for fp16/bf16 values).
template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "only the 16x16x16 shape is emulated");
  using shape = detail::tile_shape<Use, M, N, K>;
  using element_type = T;
  static constexpr int rows = shape::rows, cols = shape::cols;
  float tile[rows * cols];
};

template <typename Use, int M, int N, int K, typename T, typename Layout>
void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, T value) {
  for (float& x : f.tile) x = detail::to_float(value);
}

namespace detail {
template <typename Frag, typename P>
void load(Frag& f, const P* ptr, unsigned ldm, bool col_major) {
  if (ldm % (16 / sizeof(P)) != 0) ::cuda_emu::fail("wmma: ldm must be a multiple of 16 bytes");
  for (int r = 0; r < Frag::rows; ++r)
    for (int c = 0; c < Frag::cols; ++c) {
      const size_t at = col_major ? static_cast<size_t>(c) * ldm + r : static_cast<size_t>(r) * ldm + c;
      f.tile[r * Frag::cols + c] = to_float(ptr[at]);
    }
}
}  // namespace detail

/// matrix_a / matrix_b: the memory layout is the fragment's Layout parameter.
template <typename Use, int M, int N, int K, typename T, typename Layout>
void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const T* ptr, unsigned ldm) {
  detail::load(f, ptr, ldm, detail::is_col_major<Layout>());
}

/// accumulator: the memory layout is a run-time argument, as in CUDA.
template <int M, int N, int K, typename T>
void load_matrix_sync(fragment<accumulator, M, N, K, T>& f, const T* ptr, unsigned ldm, layout_t layout) {
  detail::load(f, ptr, ldm, layout == mem_col_major);
}

template <int M, int N, int K, typename T>
void store_matrix_sync(T* ptr, const fragment<accumulator, M, N, K, T>& f, unsigned ldm, layout_t layout) {
  if (ldm % (16 / sizeof(T)) != 0) ::cuda_emu::fail("wmma: ldm must be a multiple of 16 bytes");
  ::cuda_emu::yield(::cuda_emu::Sync::kShuffle);  // see the file comment
  const int lane = static_cast<int>(::cuda_emu::self().linear_id % 32);
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c) {
      if (((r * N + c) * 13 + 5) % 32 != lane) continue;
      const size_t at = layout == mem_col_major ? static_cast<size_t>(c) * ldm + r : static_cast<size_t>(r) * ldm + c;
      ptr[at] = detail::from_float<T>(f.tile[r * N + c]);
    }
}

/// d = a·b + c with fp32 accumulation (the summation order differs from the hardware's).
template <int M, int N, int K, typename Tab, typename LA, typename LB, typename Tc>
void mma_sync(fragment<accumulator, M, N, K, Tc>& d, const fragment<matrix_a, M, N, K, Tab, LA>& a,
              const fragment<matrix_b, M, N, K, Tab, LB>& b, const fragment<accumulator, M, N, K, Tc>& c) {
  float result[M * N];
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float sum = c.tile[i * N + j];
      for (int k = 0; k < K; ++k) sum += a.tile[i * K + k] * b.tile[k * N + j];
      result[i * N + j] = sum;
    }
  for (int i = 0; i < M * N; ++i) d.tile[i] = result[i];
}

}  // namespace wmma
}  // namespace nvcuda
