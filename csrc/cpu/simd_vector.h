// 64-byte vectors (GCC/Clang vector extensions) and the tile transposes and prefetching built on
// them, for kernels compiled as target_clones: the AVX-512 clone keeps each vector in one zmm
// register, the AVX2 and baseline clones split it. Include only from .cpp files whose callers of
// these helpers are cloned entry points, and inline everything into them (ATTN_EXT_ALWAYS_INLINE):
// an out-of-line helper would be compiled for the baseline ISA only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

#define ATTN_EXT_ALWAYS_INLINE inline __attribute__((always_inline))

// GCC notes that 64-byte vector values have a different ABI per ISA; they never cross a real call.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace attn_ext::cpu::simd {

template <typename T>
struct Vector;
template <>
struct Vector<float> {
  typedef float type __attribute__((vector_size(64)));
};
template <>
struct Vector<double> {
  typedef double type __attribute__((vector_size(64)));
};

template <typename T>
constexpr int kLanes = 64 / sizeof(T);

constexpr int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

template <typename T>
ATTN_EXT_ALWAYS_INLINE typename Vector<T>::type load(const T* p) {
  typename Vector<T>::type v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename T>
ATTN_EXT_ALWAYS_INLINE void store(T* p, const typename Vector<T>::type& v) {
  std::memcpy(p, &v, sizeof(v));
}

/// dst[0..count) = src[0..count): whole vectors, then a scalar tail. Inlined, because the rows here
/// are a few hundred bytes, where a call to memcpy costs as much as the copy.
template <typename T>
ATTN_EXT_ALWAYS_INLINE void copy_row(T* dst, const T* src, int64_t count) {
  constexpr int W = kLanes<T>;
  int64_t i = 0;
  for (; i + W <= count; i += W) store(dst + i, load(src + i));
  for (; i < count; ++i) dst[i] = src[i];
}

template <typename T>
ATTN_EXT_ALWAYS_INLINE void zero_row(T* dst, int64_t count) {
  constexpr int W = kLanes<T>;
  int64_t i = 0;
  for (; i + W <= count; i += W) store(dst + i, typename Vector<T>::type{});
  for (; i < count; ++i) dst[i] = T(0);
}

/// One step of the block-swap transpose: for rows a = r[t], b = r[t + H] (bit H of t clear), the
/// lanes whose bit H is set trade places between a's upper and b's lower H-lane groups.
template <typename T, int H, bool kSecond, size_t... J>
ATTN_EXT_ALWAYS_INLINE typename Vector<T>::type swap_lanes(const typename Vector<T>::type& a,
                                                           const typename Vector<T>::type& b, std::index_sequence<J...>) {
  constexpr size_t W = kLanes<T>;
  return __builtin_shufflevector(a, b, (kSecond ? ((J & H) ? W + J : J + H) : ((J & H) ? W + J - H : J))...);
}

template <typename T, int H>
ATTN_EXT_ALWAYS_INLINE void transpose_step(typename Vector<T>::type* r) {
  constexpr int W = kLanes<T>;
#pragma GCC unroll 16
  for (int t = 0; t < W; ++t) {
    if (t & H) continue;
    const auto first = swap_lanes<T, H, false>(r[t], r[t + H], std::make_index_sequence<W>());
    const auto second = swap_lanes<T, H, true>(r[t], r[t + H], std::make_index_sequence<W>());
    r[t] = first;
    r[t + H] = second;
  }
}

template <typename T, size_t... J>
ATTN_EXT_ALWAYS_INLINE typename Vector<T>::type lane_indices(std::index_sequence<J...>) {
  return typename Vector<T>::type{static_cast<T>(J)...};
}

/// Which triangle of a transposed diagonal tile to keep (the rest is written as zeros).
enum class Keep { kAll, kUpper, kLower };

/// dst[c·dst_ld + t] = src[t·src_ld + c] for a W×W tile (W = kLanes<T>, rows of src contiguous):
/// log2(W) rounds of W two-vector shuffles instead of W² scalar moves.
template <typename T, Keep kKeep>
ATTN_EXT_ALWAYS_INLINE void transpose_tile(const T* src, int64_t src_ld, T* dst, int64_t dst_ld) {
  using V = typename Vector<T>::type;
  constexpr int W = kLanes<T>;
  V r[W];
#pragma GCC unroll 16
  for (int t = 0; t < W; ++t) r[t] = load(src + t * src_ld);
  if constexpr (W == 16) transpose_step<T, 8>(r);
  transpose_step<T, 4>(r);
  transpose_step<T, 2>(r);
  transpose_step<T, 1>(r);
  const V lane = lane_indices<T>(std::make_index_sequence<W>());
#pragma GCC unroll 16
  for (int t = 0; t < W; ++t) {
    V v = r[t];
    if constexpr (kKeep == Keep::kUpper) v = lane >= static_cast<T>(t) ? v : V{};
    if constexpr (kKeep == Keep::kLower) v = lane <= static_cast<T>(t) ? v : V{};
    store(dst + t * dst_ld, v);
  }
}

/// Pulls a matrix that the next iteration reads (or writes: the line is then fetched for ownership)
/// towards L2, a slice per call of step(), so that its DRAM latency hides behind the current
/// matrix's arithmetic instead of stalling the next copy.
struct Prefetch {
  const char* next = nullptr;
  int64_t bytes_left = 0;
  int64_t bytes_per_step = 0;
  bool for_write = false;

  /// The memory span of a rows×cols matrix with non-negative strides, in `steps` slices; nothing if
  /// the span is much larger than the matrix (a strided view: fetching it would waste bandwidth).
  template <typename T>
  static Prefetch span(const T* base, int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride,
                       int64_t steps, bool for_write = false) {
    Prefetch p;
    const int64_t bytes = ((rows - 1) * row_stride + (cols - 1) * col_stride + 1) * static_cast<int64_t>(sizeof(T));
    if (rows <= 0 || cols <= 0 || bytes > 2 * rows * cols * static_cast<int64_t>(sizeof(T))) return p;
    p.next = reinterpret_cast<const char*>(base);
    p.bytes_left = bytes;
    p.bytes_per_step = round_up((bytes + steps - 1) / (steps > 0 ? steps : 1), 64);
    p.for_write = for_write;
    return p;
  }

  ATTN_EXT_ALWAYS_INLINE void step() {
    for (int64_t done = 0; done < bytes_per_step && bytes_left > 0; done += 64, bytes_left -= 64, next += 64) {
      if (for_write) {
        __builtin_prefetch(next, 1, 2);
      } else {
        __builtin_prefetch(next, 0, 2);
      }
    }
  }
};

}  // namespace attn_ext::cpu::simd
