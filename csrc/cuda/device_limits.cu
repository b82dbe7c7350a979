// The per-device cache of the opt-in shared-memory limit (common/device_limits.h).
#include "common/device_limits.h"

#include <atomic>

namespace attn_ext {
namespace cuda {
namespace {

/// Devices with a cache slot; a process rarely sees more, and the others are simply queried each time.
constexpr int kCachedDevices = 64;
/// 0 = not read yet (no device allows 0 bytes). Racing first reads store the same value: no lock needed.
std::atomic<std::size_t> g_smem_optin[kCachedDevices] = {};

}  // namespace

cudaError_t smem_optin_limit(int device, std::size_t* bytes) {
  const bool cached = device >= 0 && device < kCachedDevices;
  if (cached) {
    const std::size_t known = g_smem_optin[device].load(std::memory_order_relaxed);
    if (known != 0) {
      *bytes = known;
      return cudaSuccess;
    }
  }
  int value = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&value, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  *bytes = static_cast<std::size_t>(value);
  if (cached && value > 0) g_smem_optin[device].store(*bytes, std::memory_order_relaxed);
  return cudaSuccess;
}

cudaError_t current_smem_optin_limit(std::size_t* bytes) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  return err != cudaSuccess ? err : smem_optin_limit(device, bytes);
}

}  // namespace cuda
}  // namespace attn_ext
