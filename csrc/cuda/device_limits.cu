// The per-device caches of the opt-in shared-memory limit and the compute capability
// (common/device_limits.h).
#include "common/device_limits.h"

#include <atomic>

namespace attn_ext {
namespace cuda {
namespace {

/// Devices with a cache slot; a process rarely sees more, and the others are simply queried each time.
constexpr int kCachedDevices = 64;
/// 0 = not read yet (no device allows 0 bytes or has capability 0). Racing first reads store the same
/// value: no lock needed.
std::atomic<std::size_t> g_smem_optin[kCachedDevices] = {};
std::atomic<int> g_capability[kCachedDevices] = {};

bool has_slot(int device) { return device >= 0 && device < kCachedDevices; }

}  // namespace

cudaError_t smem_optin_limit(int device, std::size_t* bytes) {
  if (has_slot(device)) {
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
  if (has_slot(device) && value > 0) g_smem_optin[device].store(*bytes, std::memory_order_relaxed);
  return cudaSuccess;
}

cudaError_t current_smem_optin_limit(std::size_t* bytes) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  return err != cudaSuccess ? err : smem_optin_limit(device, bytes);
}

cudaError_t compute_capability(int device, int* capability) {
  if (has_slot(device)) {
    const int known = g_capability[device].load(std::memory_order_relaxed);
    if (known != 0) {
      *capability = known;
      return cudaSuccess;
    }
  }
  int major = 0, minor = 0;
  cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err != cudaSuccess) return err;
  *capability = 10 * major + minor;
  if (has_slot(device) && *capability > 0) g_capability[device].store(*capability, std::memory_order_relaxed);
  return cudaSuccess;
}

cudaError_t current_compute_capability(int* capability) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  return err != cudaSuccess ? err : compute_capability(device, capability);
}

}  // namespace cuda
}  // namespace attn_ext
