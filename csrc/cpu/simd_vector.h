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
// `mask`: integers of the element's width, what lane comparisons yield (all ones or zero).
template <>
struct Vector<float> {
  typedef float type __attribute__((vector_size(64)));
  typedef int32_t lane_int;
  typedef lane_int mask __attribute__((vector_size(64)));
};
template <>
struct Vector<double> {
  typedef double type __attribute__((vector_size(64)));
  typedef int64_t lane_int;
  typedef lane_int mask __attribute__((vector_size(64)));
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

// An empty asm with a memory clobber: it keeps GCC from recognising the loops below as memcpy/memset
// and calling the library, whose per-call cost exceeds a copy of one of these few-hundred-byte rows.
#define ATTN_EXT_NOT_A_LIBRARY_CALL() __asm__ volatile("" ::: "memory")

/// dst[0..count) = src[0..count): whole vectors, then a scalar tail, inline.
template <typename T>
ATTN_EXT_ALWAYS_INLINE void copy_row(T* dst, const T* src, int64_t count) {
  constexpr int W = kLanes<T>;
  int64_t i = 0;
  for (; i + W <= count; i += W) {
    store(dst + i, load(src + i));
    ATTN_EXT_NOT_A_LIBRARY_CALL();
  }
  for (; i < count; ++i) dst[i] = src[i];
}

template <typename T>
ATTN_EXT_ALWAYS_INLINE void zero_row(T* dst, int64_t count) {
  constexpr int W = kLanes<T>;
  int64_t i = 0;
  for (; i + W <= count; i += W) {
    store(dst + i, typename Vector<T>::type{});
    ATTN_EXT_NOT_A_LIBRARY_CALL();
  }
  for (; i < count; ++i) dst[i] = T(0);
}

/// The two-vector shuffles of the classic in-register transposes, each a single AVX-512 instruction
/// (vunpcklps/vunpckhps, vunpcklpd/vunpckhpd, vshuff32x4/vshuff64x2), written as lane patterns so
/// that they stay portable: element j of the result is element index(j) of the concatenation a:b.
enum class Shuffle { kLow32, kHigh32, kLow64, kHigh64, kEvenLanes, kOddLanes };

template <typename T, Shuffle kShuffle>
constexpr int shuffle_index(int j) {
  constexpr int W = kLanes<T>, per_lane = 16 / sizeof(T);  // elements per 128-bit lane
  const int lane = j / per_lane, k = j % per_lane, base = lane * per_lane;
  const int pair = 8 / sizeof(T);  // elements per 64-bit pair
  switch (kShuffle) {
    case Shuffle::kLow32: return base + k / 2 + (k % 2 ? W : 0);
    case Shuffle::kHigh32: return base + per_lane / 2 + k / 2 + (k % 2 ? W : 0);
    case Shuffle::kLow64: return base + k % pair + (k / pair ? W : 0);
    case Shuffle::kHigh64: return base + pair + k % pair + (k / pair ? W : 0);
    case Shuffle::kEvenLanes: return (lane < 2 ? 0 : W) + (lane % 2) * 2 * per_lane + k;
    case Shuffle::kOddLanes: return (lane < 2 ? 0 : W) + ((lane % 2) * 2 + 1) * per_lane + k;
  }
  return 0;
}

template <typename T, Shuffle kShuffle, size_t... J>
ATTN_EXT_ALWAYS_INLINE typename Vector<T>::type shuffle(const typename Vector<T>::type& a,
                                                        const typename Vector<T>::type& b, std::index_sequence<J...>) {
  return __builtin_shufflevector(a, b, shuffle_index<T, kShuffle>(J)...);
}

template <typename T, Shuffle kShuffle>
ATTN_EXT_ALWAYS_INLINE typename Vector<T>::type shuffle(const typename Vector<T>::type& a,
                                                        const typename Vector<T>::type& b) {
  return shuffle<T, kShuffle>(a, b, std::make_index_sequence<kLanes<T>>());
}

/// r[i] ← column i of the W×W matrix whose rows are r[0..W): interleave neighbouring rows by single
/// elements (floats only), then by pairs, then exchange 128-bit lanes twice — 4·16 (3·8) shuffles.
template <typename T>
ATTN_EXT_ALWAYS_INLINE void transpose_in_registers(typename Vector<T>::type* r) {
  using V = typename Vector<T>::type;
  constexpr int W = kLanes<T>;
  V t[W];
  if constexpr (W == 16) {
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = shuffle<T, Shuffle::kLow32>(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = shuffle<T, Shuffle::kHigh32>(r[2 * i], r[2 * i + 1]);
    }
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      r[4 * g] = shuffle<T, Shuffle::kLow64>(t[4 * g], t[4 * g + 2]);
      r[4 * g + 1] = shuffle<T, Shuffle::kHigh64>(t[4 * g], t[4 * g + 2]);
      r[4 * g + 2] = shuffle<T, Shuffle::kLow64>(t[4 * g + 1], t[4 * g + 3]);
      r[4 * g + 3] = shuffle<T, Shuffle::kHigh64>(t[4 * g + 1], t[4 * g + 3]);
    }
  } else {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = shuffle<T, Shuffle::kLow64>(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = shuffle<T, Shuffle::kHigh64>(r[2 * i], r[2 * i + 1]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) r[i] = t[i];
  }
  // Lane exchanges: within each half (rows h·W/2 + k and h·W/2 + W/4 + k), then across the halves.
  constexpr int kHalf = W / 2, kQuarter = W / 4;
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 4
    for (int k = 0; k < kQuarter; ++k) {
      t[h * kHalf + k] = shuffle<T, Shuffle::kEvenLanes>(r[h * kHalf + k], r[h * kHalf + kQuarter + k]);
      t[h * kHalf + kQuarter + k] = shuffle<T, Shuffle::kOddLanes>(r[h * kHalf + k], r[h * kHalf + kQuarter + k]);
    }
  }
#pragma GCC unroll 8
  for (int k = 0; k < kHalf; ++k) {
    r[k] = shuffle<T, Shuffle::kEvenLanes>(t[k], t[kHalf + k]);
    r[kHalf + k] = shuffle<T, Shuffle::kOddLanes>(t[k], t[kHalf + k]);
  }
}

/// Which triangle of a transposed diagonal tile to keep (the rest is written as zeros).
enum class Keep { kAll, kUpper, kLower };

/// Constant lane masks, loaded rather than computed: GCC assembles vector constants and lane
/// comparisons against a broadcast index lane by lane (a masked broadcast per lane) in these
/// inlined functions.
template <typename T>
struct LaneMasks {
  using Int = typename Vector<T>::lane_int;
  static constexpr int W = kLanes<T>;
  alignas(64) Int before[W + 1][W];  // row k: all ones in the lanes j < k
  alignas(64) Int at[W + 1][W];      // row k < W: all ones in lane k only; row W: none
  constexpr LaneMasks() : before(), at() {
    for (int k = 0; k <= W; ++k) {
      for (int j = 0; j < W; ++j) {
        before[k][j] = j < k ? Int(-1) : Int(0);
        at[k][j] = j == k ? Int(-1) : Int(0);
      }
    }
  }
};

template <typename T>
inline constexpr LaneMasks<T> kLaneMasks{};

template <typename T>
ATTN_EXT_ALWAYS_INLINE typename Vector<T>::mask load_mask(const typename Vector<T>::lane_int* p) {
  typename Vector<T>::mask m;
  std::memcpy(&m, p, sizeof(m));
  return m;
}

/// Lanes j with j < k, for any integer k.
template <typename T>
ATTN_EXT_ALWAYS_INLINE typename Vector<T>::mask lanes_before(int64_t k) {
  return load_mask<T>(kLaneMasks<T>.before[k < 0 ? 0 : (k > kLanes<T> ? kLanes<T> : k)]);
}

/// Lane k alone, or no lane if k is outside [0, W).
template <typename T>
ATTN_EXT_ALWAYS_INLINE typename Vector<T>::mask lane_at(int64_t k) {
  return load_mask<T>(kLaneMasks<T>.at[k < 0 || k >= kLanes<T> ? kLanes<T> : k]);
}

/// a in the lanes where `mask` is all ones, b where it is zero. Bitwise, because GCC lowers the
/// vector ?: on floating lanes to per-lane code here.
template <typename T>
ATTN_EXT_ALWAYS_INLINE typename Vector<T>::type select(const typename Vector<T>::mask& mask,
                                                       const typename Vector<T>::type& a,
                                                       const typename Vector<T>::type& b) {
  using V = typename Vector<T>::type;
  using M = typename Vector<T>::mask;
  return (V)((mask & (M)a) | (~mask & (M)b));
}

/// dst[c·dst_ld + t] = src[t·src_ld + c] for a W×W tile (W = kLanes<T>, rows of src contiguous),
/// in registers instead of W² scalar moves.
template <typename T, Keep kKeep>
ATTN_EXT_ALWAYS_INLINE void transpose_tile(const T* src, int64_t src_ld, T* dst, int64_t dst_ld) {
  using V = typename Vector<T>::type;
  constexpr int W = kLanes<T>;
  V r[W];
#pragma GCC unroll 16
  for (int t = 0; t < W; ++t) r[t] = load(src + t * src_ld);
  transpose_in_registers<T>(r);
#pragma GCC unroll 16
  for (int t = 0; t < W; ++t) {
    V v = r[t];
    if constexpr (kKeep == Keep::kUpper) v = select<T>(lanes_before<T>(t), V{}, v);
    if constexpr (kKeep == Keep::kLower) v = select<T>(lanes_before<T>(t + 1), v, V{});
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
