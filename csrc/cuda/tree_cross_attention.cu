// Launchers of the CUDA Tree Cross Attention forward and backward: plan, opt in to the shared memory
// the per-warp state needs, dispatch the dtype (3 instantiations per kernel; sizes are runtime).
#include "tree_cross_attention.cuh"

#include "tree_cross_attention_bwd_kernel.cuh"
#include "tree_cross_attention_fwd_kernel.cuh"

namespace attn_ext {
namespace cuda {
namespace {

template <typename Kernel, typename Params>
cudaError_t launch(Kernel kernel, const TreeLaunchPlan& plan, const Params& p, cudaStream_t stream) {
  if (plan.shared_memory_bytes > kTreeDefaultSmemBytes) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(plan.shared_memory_bytes));
    if (err != cudaSuccess) return err;
  }
  kernel<<<dim3(plan.grid.x), dim3(plan.block.x), plan.shared_memory_bytes, stream>>>(p);
  return cudaGetLastError();
}

bool shape_consistent(const TreeShapeParams& s) {
  return s.selected == s.height * (s.branching - 1) + s.group_size && s.group_offset >= 0 &&
         s.leaf_offset > s.group_offset && s.nodes >= s.leaf_offset;
}

}  // namespace

cudaError_t launch_tree_cross_attention_fwd(const TreeFwdParams& p, cudaStream_t stream) {
  const TreeShapeParams& s = p.s;
  const TreeLaunchPlan plan =
      plan_tree_cross_attention(s.B, s.M, s.H, s.D, s.Dv, s.branching, s.group_size, s.height, false);
  if (!plan.supported || !shape_consistent(s)) return cudaErrorInvalidValue;
  if (plan.empty) return cudaSuccess;
  if (p.q == nullptr || p.node_k == nullptr || p.node_v == nullptr || p.node_padding_mask == nullptr ||
      p.out == nullptr || p.lse == nullptr || p.selected == nullptr || p.log_prob == nullptr || p.entropy == nullptr) {
    return cudaErrorInvalidValue;
  }
  switch (s.dtype) {
    case ScalarType::kFloat32: return launch(detail::tree_cross_attention_fwd_kernel<float>, plan, p, stream);
    case ScalarType::kFloat16: return launch(detail::tree_cross_attention_fwd_kernel<__half>, plan, p, stream);
    case ScalarType::kBFloat16:
      return launch(detail::tree_cross_attention_fwd_kernel<__nv_bfloat16>, plan, p, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_tree_cross_attention_bwd(const TreeBwdParams& p, cudaStream_t stream) {
  const TreeShapeParams& s = p.s;
  const TreeLaunchPlan plan =
      plan_tree_cross_attention(s.B, s.M, s.H, s.D, s.Dv, s.branching, s.group_size, s.height, true);
  if (!plan.supported || !shape_consistent(s)) return cudaErrorInvalidValue;
  if (plan.empty) return cudaSuccess;
  if (p.grad_out == nullptr || p.grad_lse == nullptr || p.grad_log_prob == nullptr || p.grad_entropy == nullptr ||
      p.q == nullptr || p.node_k == nullptr || p.node_v == nullptr || p.node_padding_mask == nullptr ||
      p.selected == nullptr || p.lse == nullptr || p.grad_q == nullptr || p.grad_node_k == nullptr ||
      p.grad_node_v == nullptr) {
    return cudaErrorInvalidValue;
  }
  switch (s.dtype) {
    case ScalarType::kFloat32: return launch(detail::tree_cross_attention_bwd_kernel<float>, plan, p, stream);
    case ScalarType::kFloat16: return launch(detail::tree_cross_attention_bwd_kernel<__half>, plan, p, stream);
    case ScalarType::kBFloat16:
      return launch(detail::tree_cross_attention_bwd_kernel<__nv_bfloat16>, plan, p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace attn_ext
