// How the launch plans fit their shared-memory tiles into a device: the opt-in limit per block they are
// given, which smaller tiles are compiled, and how a plan says that none fits.
//
// Every kernel's preferred (fastest) tile was sized for sm_80 (163 KiB of opt-in shared memory per
// block) and sm_90 (227 KiB). Other GPUs allow less: sm_86, sm_89 and sm_120 99 KiB, sm_70 96 KiB,
// sm_75 64 KiB. Compiling every smaller tile of every kernel would multiply compile time, so a kernel
// gets a fall-back tile only where one of two tiers of limit needs it, the largest tile that fits:
//  * 96 KiB, sm_70's limit; a tile that fits it also fits the 99 KiB of sm_86/sm_89/sm_120;
//  * 64 KiB, sm_75's limit.
// A plan then takes, among the compiled tiles, the largest that fits the device it runs on, so the
// preferred tile is kept wherever it fits (sm_80 and sm_90 plans are unchanged).
//
// Plain C++17 without CUDA headers, like the plans built on it.
#pragma once

#include <cstddef>
#include <string>

namespace attn_ext {
namespace cuda {

/// The tiers of opt-in shared memory per block that fall-back tiles are compiled for (see above).
constexpr std::size_t kSmemTier96KiB = 96 * 1024;
constexpr std::size_t kSmemTier64KiB = 64 * 1024;
/// sm_80's opt-in limit, the smallest of the architectures the preferred tiles were sized for.
constexpr std::size_t kSmemSm80Bytes = 163 * 1024;

/// Why a plan found no tile: set (kernel != nullptr) only when shared memory was the reason.
struct SmemShortfall {
  const char* kernel = nullptr;  ///< the kernel, in words
  std::size_t needed_bytes = 0;  ///< shared memory per block of its smallest compiled tile
  std::size_t limit_bytes = 0;   ///< the device's opt-in limit the plan was given
};

/// The error every plan reports when no compiled tile fits; SmemShortfall says which kernel and how much.
constexpr const char* kSmemShortfallError = "no compiled tile of the kernel fits the device's shared memory per block";

/// Records a shortfall and returns the plan error that goes with it.
inline const char* smem_shortfall(SmemShortfall& out, const char* kernel, std::size_t needed, std::size_t limit) {
  out.kernel = kernel, out.needed_bytes = needed, out.limit_bytes = limit;
  return kSmemShortfallError;
}

/// A plan's error in full: the error string, and for a shortfall the kernel, the bytes its smallest
/// tile needs and the device's limit (what the torch bindings raise).
inline std::string plan_error_message(const char* error, const SmemShortfall& s) {
  std::string message = error == nullptr ? "unsupported" : error;
  if (s.kernel != nullptr) {
    message += ": the " + std::string(s.kernel) + " needs " + std::to_string(s.needed_bytes) +
               " bytes of shared memory per block with its smallest tile, and this device allows " +
               std::to_string(s.limit_bytes) + " (cudaDevAttrMaxSharedMemoryPerBlockOptin)";
  }
  return message;
}

// Tile choice for kernels whose tile size halves (warps per block, rows per warp): candidates are
// preferred, preferred/2, ..., 1, and `bytes(t)` is the shared memory of candidate t. Generic so that
// the launchers' `if constexpr` and the plans evaluate the very same rule.

/// The largest candidate whose shared memory fits `limit`; 0 if none.
template <typename Bytes>
constexpr int largest_tile_within(int preferred, std::size_t limit, Bytes bytes) {
  for (int t = preferred; t >= 1; t /= 2) {
    if (bytes(t) <= limit) return t;
  }
  return 0;
}

/// Whether candidate `tile` has a kernel instantiation: the preferred tile, and the largest one that
/// fits each tier.
template <typename Bytes>
constexpr bool tile_is_compiled(int preferred, int tile, Bytes bytes) {
  return tile == preferred || tile == largest_tile_within(preferred, kSmemTier96KiB, bytes) ||
         tile == largest_tile_within(preferred, kSmemTier64KiB, bytes);
}

/// The plan's choice: the largest compiled candidate that fits `limit`; 0 if none.
template <typename Bytes>
constexpr int compiled_tile_within(int preferred, std::size_t limit, Bytes bytes) {
  for (int t = preferred; t >= 1; t /= 2) {
    if (tile_is_compiled(preferred, t, bytes) && bytes(t) <= limit) return t;
  }
  return 0;
}

/// The smallest compiled candidate (what a device needs at least, for the error message).
template <typename Bytes>
constexpr int smallest_compiled_tile(int preferred, Bytes bytes) {
  int smallest = preferred;
  for (int t = preferred; t >= 1; t /= 2) {
    if (tile_is_compiled(preferred, t, bytes)) smallest = t;
  }
  return smallest;
}

}  // namespace cuda
}  // namespace attn_ext
