// Launch geometry of the strided batched GEMM under the CUDA Intention kernels, as plain C++17
// (tested on the host by csrc/tests/cuda_intention_emulation_test.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/launch_geometry.h"
#include "common/smem_limits.h"

namespace attn_ext {
namespace cuda {

/// Output tile (rows = columns) of one block, and the depth of one shared-memory step of the reduction.
constexpr int kSmallGemmTile = 32;
/// Threads per block: 32 columns × 8 row groups, each thread owns 4 rows of one column.
constexpr int kSmallGemmThreads = 256;

/// Dynamic shared memory: an A and a B tile of 32×33 floats (+1 column against bank conflicts).
constexpr std::size_t small_gemm_smem_bytes() {
  return 2 * sizeof(float) * kSmallGemmTile * (kSmallGemmTile + 1);
}

struct SmallGemmLaunchPlan {
  bool supported = false;
  const char* error = nullptr;
  bool empty = false;
  LaunchDims grid;  ///< x = batch_item · row_tiles + row_tile, y = column tile
  LaunchDims block;
  std::size_t shared_memory_bytes = 0;
  int64_t row_tiles = 0;
  SmemShortfall smem;  ///< set when the two tiles do not fit the device
};

/// Plans C[batch_items] (rows × cols) for any inner size (0 gives C = 0) on a device with `smem_limit`
/// bytes of shared memory per block. The tiles take 8.25 KiB, below the 48 KiB every device gives
/// without opting in: the limit is checked for the rule's sake, no device is refused.
inline SmallGemmLaunchPlan plan_small_gemm(int64_t batch_items, int64_t rows, int64_t cols, std::size_t smem_limit) {
  SmallGemmLaunchPlan plan;
  if (batch_items < 0 || rows < 0 || cols < 0) {
    plan.error = "negative size";
    return plan;
  }
  plan.block.x = kSmallGemmThreads;
  plan.shared_memory_bytes = small_gemm_smem_bytes();
  if (plan.shared_memory_bytes > smem_limit) {
    plan.error = smem_shortfall(plan.smem, "batched GEMM of Intention", plan.shared_memory_bytes, smem_limit);
    return plan;
  }
  plan.supported = true;
  if (batch_items == 0 || rows == 0 || cols == 0) {
    plan.empty = true;
    plan.grid.x = 0;
    return plan;
  }
  plan.row_tiles = (rows + kSmallGemmTile - 1) / kSmallGemmTile;
  const int64_t col_tiles = (cols + kSmallGemmTile - 1) / kSmallGemmTile;
  if (plan.row_tiles > kMaxGridX / batch_items || col_tiles > kMaxGridY) {
    plan.supported = false;
    plan.error = "too many blocks for the CUDA grid (batch·heads·ceil(rows/32) or ceil(cols/32))";
    return plan;
  }
  plan.grid.x = static_cast<unsigned int>(batch_items * plan.row_tiles);
  plan.grid.y = static_cast<unsigned int>(col_tiles);
  return plan;
}

}  // namespace cuda
}  // namespace attn_ext
