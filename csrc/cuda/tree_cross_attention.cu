// Launchers of the CUDA Tree Cross Attention forward and backward: plan, opt in to the shared memory
// the per-warp state needs, dispatch the dtype (3 instantiations per kernel; sizes are runtime).
#include "tree_cross_attention.cuh"

#include "common/device_limits.h"
#include "common/launch.cuh"
#include "tree_cross_attention_bwd_kernel.cuh"
#include "tree_cross_attention_fwd_kernel.cuh"

namespace attn_ext {
namespace cuda {
namespace {

/// The plan of a call on a device with `smem_limit` bytes of shared memory per block; unsupported too
/// when the params' tree ids disagree with its sizes.
TreeLaunchPlan plan_of(const TreeShapeParams& s, bool backward, std::size_t smem_limit) {
  TreeLaunchPlan plan = plan_tree_cross_attention(s.B, s.M, s.H, s.D, s.Dv, s.branching, s.group_size, s.height,
                                                  backward, smem_limit);
  const bool consistent = s.selected == s.height * (s.branching - 1) + s.group_size && s.group_offset >= 0 &&
                          s.leaf_offset > s.group_offset && s.nodes >= s.leaf_offset;
  if (!consistent) plan.supported = false;
  return plan;
}

}  // namespace

cudaError_t launch_tree_cross_attention_fwd(const TreeFwdParams& p, cudaStream_t stream) {
  std::size_t smem_limit = 0;
  const cudaError_t err = current_smem_optin_limit(&smem_limit);
  if (err != cudaSuccess) return err;
  const TreeLaunchPlan plan = plan_of(p.s, false, smem_limit);
  if (!plan.supported) return cudaErrorInvalidValue;
  if (plan.empty) return cudaSuccess;
  if (p.q == nullptr || p.node_k == nullptr || p.node_v == nullptr || p.node_padding_mask == nullptr ||
      p.out == nullptr || p.lse == nullptr || p.selected == nullptr || p.log_prob == nullptr || p.entropy == nullptr) {
    return cudaErrorInvalidValue;
  }
  return detail::dispatch_attention_dtype(p.s.dtype, [&](auto scalar) {
    return detail::launch_with_smem(detail::tree_cross_attention_fwd_kernel<decltype(scalar)>, plan.grid, plan.block,
                                    plan.shared_memory_bytes, stream, p);
  });
}

cudaError_t launch_tree_cross_attention_bwd(const TreeBwdParams& p, cudaStream_t stream) {
  std::size_t smem_limit = 0;
  const cudaError_t err = current_smem_optin_limit(&smem_limit);
  if (err != cudaSuccess) return err;
  const TreeLaunchPlan plan = plan_of(p.s, true, smem_limit);
  if (!plan.supported) return cudaErrorInvalidValue;
  if (plan.empty) return cudaSuccess;
  if (p.grad_out == nullptr || p.grad_lse == nullptr || p.grad_log_prob == nullptr || p.grad_entropy == nullptr ||
      p.q == nullptr || p.node_k == nullptr || p.node_v == nullptr || p.node_padding_mask == nullptr ||
      p.selected == nullptr || p.lse == nullptr || p.grad_q == nullptr || p.grad_node_k == nullptr ||
      p.grad_node_v == nullptr) {
    return cudaErrorInvalidValue;
  }
  return detail::dispatch_attention_dtype(p.s.dtype, [&](auto scalar) {
    return detail::launch_with_smem(detail::tree_cross_attention_bwd_kernel<decltype(scalar)>, plan.grid, plan.block,
                                    plan.shared_memory_bytes, stream, p);
  });
}

}  // namespace cuda
}  // namespace attn_ext
