// Fixed-width vectors (GCC/Clang vector extensions of VB = 16, 32 or 64 bytes) and the tile
// transposes, lane masks, row copies and prefetching built on them, for kernels compiled once per
// instruction set (VB = 64 for AVX-512, 32 for AVX2, 16 for SSE2). Include only from .cpp files, and
// inline everything (ATTN_EXT_ALWAYS_INLINE) into functions compiled for the ISA that matches VB:
// an out-of-line helper would be compiled for the baseline ISA only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#define ATTN_EXT_ALWAYS_INLINE inline __attribute__((always_inline))

// GCC notes that wide vector values have a different ABI per ISA; they never cross a real call.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace attn_ext::cpu::simd {

/// `type`: VB bytes of T; `mask`: integers of T's width, what lane comparisons yield (all ones or 0).
template <typename T, int VB>
struct Vector {
  typedef T type __attribute__((vector_size(VB)));
  typedef std::conditional_t<sizeof(T) == 4, int32_t, int64_t> lane_int;
  typedef lane_int mask __attribute__((vector_size(VB)));
};

template <typename T, int VB>
constexpr int kLanes = VB / sizeof(T);

constexpr int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

template <typename T, int VB>
ATTN_EXT_ALWAYS_INLINE typename Vector<T, VB>::type load(const T* p) {
  typename Vector<T, VB>::type v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename T, int VB>
ATTN_EXT_ALWAYS_INLINE void store(T* p, const typename Vector<T, VB>::type& v) {
  std::memcpy(p, &v, sizeof(v));
}

// An empty asm with a memory clobber: it keeps GCC from recognising the loops below as memcpy/memset
// and calling the library, whose per-call cost exceeds a copy of one of these few-hundred-byte rows.
#define ATTN_EXT_NOT_A_LIBRARY_CALL() __asm__ volatile("" ::: "memory")

/// dst[0..count) = src[0..count): whole vectors, then a scalar tail, inline.
template <typename T, int VB>
ATTN_EXT_ALWAYS_INLINE void copy_row(T* dst, const T* src, int64_t count) {
  constexpr int W = kLanes<T, VB>;
  int64_t i = 0;
  for (; i + W <= count; i += W) {
    store<T, VB>(dst + i, load<T, VB>(src + i));
    ATTN_EXT_NOT_A_LIBRARY_CALL();
  }
  for (; i < count; ++i) dst[i] = src[i];
}

template <typename T, int VB>
ATTN_EXT_ALWAYS_INLINE void zero_row(T* dst, int64_t count) {
  constexpr int W = kLanes<T, VB>;
  int64_t i = 0;
  for (; i + W <= count; i += W) {
    store<T, VB>(dst + i, typename Vector<T, VB>::type{});
    ATTN_EXT_NOT_A_LIBRARY_CALL();
  }
  for (; i < count; ++i) dst[i] = T(0);
}

/// Element j of the result is element index(j) of the concatenation a:b, for the two-vector
/// shuffles of the transposes below.
enum class Shuffle { kLow32, kHigh32, kLow64, kHigh64, kEvenLanes, kOddLanes, kSwapLow, kSwapHigh };

template <typename T, int VB, Shuffle kShuffle, int H>
constexpr int shuffle_index(int j) {
  constexpr int W = kLanes<T, VB>, per_lane = 16 / sizeof(T);  // elements per 128-bit lane
  const int lane = j / per_lane, k = j % per_lane, base = lane * per_lane;
  const int pair = 8 / sizeof(T);  // elements per 64-bit pair
  switch (kShuffle) {
    // Single AVX-512 instructions: vunpck{l,h}ps, vunpck{l,h}pd, vshuff32x4 / vshuff64x2.
    case Shuffle::kLow32: return base + k / 2 + (k % 2 ? W : 0);
    case Shuffle::kHigh32: return base + per_lane / 2 + k / 2 + (k % 2 ? W : 0);
    case Shuffle::kLow64: return base + k % pair + (k / pair ? W : 0);
    case Shuffle::kHigh64: return base + pair + k % pair + (k / pair ? W : 0);
    case Shuffle::kEvenLanes: return (lane < 2 ? 0 : W) + (lane % 2) * 2 * per_lane + k;
    case Shuffle::kOddLanes: return (lane < 2 ? 0 : W) + ((lane % 2) * 2 + 1) * per_lane + k;
    // The block swap of any width: the lanes whose bit H is set trade places between a and b.
    case Shuffle::kSwapLow: return (j & H) ? W + j - H : j;
    case Shuffle::kSwapHigh: return (j & H) ? W + j : j + H;
  }
  return 0;
}

template <typename T, int VB, Shuffle kShuffle, int H = 0, size_t... J>
ATTN_EXT_ALWAYS_INLINE typename Vector<T, VB>::type shuffle(const typename Vector<T, VB>::type& a,
                                                            const typename Vector<T, VB>::type& b,
                                                            std::index_sequence<J...>) {
  return __builtin_shufflevector(a, b, shuffle_index<T, VB, kShuffle, H>(J)...);
}

template <typename T, int VB, Shuffle kShuffle, int H = 0>
ATTN_EXT_ALWAYS_INLINE typename Vector<T, VB>::type shuffle(const typename Vector<T, VB>::type& a,
                                                            const typename Vector<T, VB>::type& b) {
  return shuffle<T, VB, kShuffle, H>(a, b, std::make_index_sequence<kLanes<T, VB>>());
}

/// One round of the block-swap transpose, for any width: rows t and t + H (bit H of t clear)
/// exchange their H-lane groups.
template <typename T, int VB, int H>
ATTN_EXT_ALWAYS_INLINE void swap_round(typename Vector<T, VB>::type* r) {
  constexpr int W = kLanes<T, VB>;
#pragma GCC unroll 16
  for (int t = 0; t < W; ++t) {
    if (t & H) continue;
    const auto first = shuffle<T, VB, Shuffle::kSwapLow, H>(r[t], r[t + H]);
    const auto second = shuffle<T, VB, Shuffle::kSwapHigh, H>(r[t], r[t + H]);
    r[t] = first;
    r[t + H] = second;
  }
}

/// r[i] ← column i of the W×W matrix whose rows are r[0..W).
template <typename T, int VB>
ATTN_EXT_ALWAYS_INLINE void transpose_in_registers(typename Vector<T, VB>::type* r) {
  using V = typename Vector<T, VB>::type;
  constexpr int W = kLanes<T, VB>;
  if constexpr (VB != 64) {
    // Narrower vectors (AVX2, SSE2): log2(W) block-swap rounds; a few instructions per shuffle.
    if constexpr (W >= 16) swap_round<T, VB, 8>(r);
    if constexpr (W >= 8) swap_round<T, VB, 4>(r);
    if constexpr (W >= 4) swap_round<T, VB, 2>(r);
    swap_round<T, VB, 1>(r);
  } else {
    // AVX-512: interleave neighbouring rows by single elements (floats only), then by pairs, then
    // exchange 128-bit lanes twice; every shuffle is one instruction, 64 (floats) or 24 in all.
    V t[W];
    if constexpr (W == 16) {
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        t[2 * i] = shuffle<T, VB, Shuffle::kLow32>(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = shuffle<T, VB, Shuffle::kHigh32>(r[2 * i], r[2 * i + 1]);
      }
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        r[4 * g] = shuffle<T, VB, Shuffle::kLow64>(t[4 * g], t[4 * g + 2]);
        r[4 * g + 1] = shuffle<T, VB, Shuffle::kHigh64>(t[4 * g], t[4 * g + 2]);
        r[4 * g + 2] = shuffle<T, VB, Shuffle::kLow64>(t[4 * g + 1], t[4 * g + 3]);
        r[4 * g + 3] = shuffle<T, VB, Shuffle::kHigh64>(t[4 * g + 1], t[4 * g + 3]);
      }
    } else {
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        t[2 * i] = shuffle<T, VB, Shuffle::kLow64>(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = shuffle<T, VB, Shuffle::kHigh64>(r[2 * i], r[2 * i + 1]);
      }
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) r[i] = t[i];
    }
    // Lane exchanges: within each half (rows h·W/2 + k and h·W/2 + W/4 + k), then across halves.
    constexpr int kHalf = W / 2, kQuarter = W / 4;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 4
      for (int k = 0; k < kQuarter; ++k) {
        const V& a = r[h * kHalf + k];
        const V& b = r[h * kHalf + kQuarter + k];
        t[h * kHalf + k] = shuffle<T, VB, Shuffle::kEvenLanes>(a, b);
        t[h * kHalf + kQuarter + k] = shuffle<T, VB, Shuffle::kOddLanes>(a, b);
      }
    }
#pragma GCC unroll 8
    for (int k = 0; k < kHalf; ++k) {
      r[k] = shuffle<T, VB, Shuffle::kEvenLanes>(t[k], t[kHalf + k]);
      r[kHalf + k] = shuffle<T, VB, Shuffle::kOddLanes>(t[k], t[kHalf + k]);
    }
  }
}

/// Which triangle of a transposed diagonal tile to keep (the rest is written as zeros).
enum class Keep { kAll, kUpper, kLower };

/// Constant lane masks, loaded rather than computed: GCC assembles vector constants and lane
/// comparisons against a broadcast index lane by lane (a masked broadcast per lane) in these
/// inlined functions.
template <typename T, int VB>
struct LaneMasks {
  using Int = typename Vector<T, VB>::lane_int;
  static constexpr int W = kLanes<T, VB>;
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

template <typename T, int VB>
inline constexpr LaneMasks<T, VB> kLaneMasks{};

template <typename T, int VB>
ATTN_EXT_ALWAYS_INLINE typename Vector<T, VB>::mask load_mask(const typename Vector<T, VB>::lane_int* p) {
  typename Vector<T, VB>::mask m;
  std::memcpy(&m, p, sizeof(m));
  return m;
}

/// Lanes j with j < k, for any integer k.
template <typename T, int VB>
ATTN_EXT_ALWAYS_INLINE typename Vector<T, VB>::mask lanes_before(int64_t k) {
  constexpr int W = kLanes<T, VB>;
  return load_mask<T, VB>(kLaneMasks<T, VB>.before[k < 0 ? 0 : (k > W ? W : k)]);
}

/// Lane k alone, or no lane if k is outside [0, W).
template <typename T, int VB>
ATTN_EXT_ALWAYS_INLINE typename Vector<T, VB>::mask lane_at(int64_t k) {
  constexpr int W = kLanes<T, VB>;
  return load_mask<T, VB>(kLaneMasks<T, VB>.at[k < 0 || k >= W ? W : k]);
}

/// a in the lanes where `mask` is all ones, b where it is zero. Bitwise, because GCC lowers the
/// vector ?: on floating lanes to per-lane code here.
template <typename T, int VB>
ATTN_EXT_ALWAYS_INLINE typename Vector<T, VB>::type select(const typename Vector<T, VB>::mask& mask,
                                                           const typename Vector<T, VB>::type& a,
                                                           const typename Vector<T, VB>::type& b) {
  using V = typename Vector<T, VB>::type;
  using M = typename Vector<T, VB>::mask;
  return (V)((mask & (M)a) | (~mask & (M)b));
}

/// dst[c·dst_ld + t] = src[t·src_ld + c] for a W×W tile (W = kLanes, rows of src contiguous), in
/// registers instead of W² scalar moves; a diagonal tile keeps one triangle and zeros the other.
template <typename T, int VB, Keep kKeep>
ATTN_EXT_ALWAYS_INLINE void transpose_tile(const T* src, int64_t src_ld, T* dst, int64_t dst_ld) {
  using V = typename Vector<T, VB>::type;
  constexpr int W = kLanes<T, VB>;
  V r[W];
#pragma GCC unroll 16
  for (int t = 0; t < W; ++t) r[t] = load<T, VB>(src + t * src_ld);
  transpose_in_registers<T, VB>(r);
#pragma GCC unroll 16
  for (int t = 0; t < W; ++t) {
    V v = r[t];
    if constexpr (kKeep == Keep::kUpper) v = select<T, VB>(lanes_before<T, VB>(t), V{}, v);
    if constexpr (kKeep == Keep::kLower) v = select<T, VB>(lanes_before<T, VB>(t + 1), v, V{});
    store<T, VB>(dst + t * dst_ld, v);
  }
}

/// Pulls a matrix that the next iteration reads (or writes: then it is fetched ahead of the stores)
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
