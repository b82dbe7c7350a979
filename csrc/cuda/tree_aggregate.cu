// Launchers of the CUDA tree aggregation: one launch per tree level (levels depend on each other),
// three dtype instantiations per kernel.
#include "tree_aggregate.cuh"

#include "common/launch.cuh"
#include "tree_aggregate_kernel.cuh"

namespace attn_ext {
namespace cuda {
namespace {

/// First id and width of `level` (heap layout: level L holds ids (b^L − 1)/(b − 1) … + b^L − 1).
struct Level {
  int64_t first, width;
};
Level level_of(int64_t branching, int64_t level) {
  int64_t width = 1;
  for (int64_t i = 0; i < level; ++i) width *= branching;
  return Level{(width - 1) / (branching - 1), width};
}

bool shape_ok(const TreeAggregateShape& s) {
  if (s.B < 0 || s.tokens < 0 || s.E < 0 || s.branching < 2 || s.height < 0 || s.height > 62 || s.group_size < 1) {
    return false;
  }
  const Level groups = level_of(s.branching, s.height);
  return s.group_offset == groups.first && s.leaf_offset == groups.first + groups.width &&
         s.nodes == s.leaf_offset + groups.width * s.group_size;
}

template <typename scalar_t>
cudaError_t fwd(const TreeAggregateFwdParams& p, cudaStream_t stream) {
  const TreeAggregateShape& s = p.s;
  for (int64_t level = s.height; level >= 0; --level) {
    const Level l = level_of(s.branching, level);
    const TreeLaunchPlan plan = plan_tree_aggregate(s.B * l.width, s.E);
    if (!plan.supported) return cudaErrorInvalidValue;
    if (plan.empty) return cudaSuccess;
    detail::tree_aggregate_level_kernel<scalar_t><<<dim3(plan.grid.x, plan.grid.y), dim3(plan.block.x), 0, stream>>>(
        p, l.first, l.width, level == s.height);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <typename scalar_t>
cudaError_t bwd(const TreeAggregateBwdParams& p, cudaStream_t stream) {
  const TreeAggregateShape& s = p.s;
  const int64_t slots = s.B * (s.nodes - s.leaf_offset);
  if (slots > 0) {
    const int64_t blocks = (slots + kTreeAggregateThreads - 1) / kTreeAggregateThreads;
    if (blocks > kMaxGridX) return cudaErrorInvalidValue;
    detail::tree_aggregate_slot_check_kernel<<<dim3(static_cast<unsigned int>(blocks)), dim3(kTreeAggregateThreads), 0,
                                               stream>>>(p);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  for (int64_t level = 0; level <= s.height; ++level) {
    const Level l = level_of(s.branching, level);
    const TreeLaunchPlan plan = plan_tree_aggregate(s.B * l.width, s.E);
    if (!plan.supported) return cudaErrorInvalidValue;
    if (plan.empty) break;
    detail::tree_aggregate_share_kernel<scalar_t><<<dim3(plan.grid.x, plan.grid.y), dim3(plan.block.x), 0, stream>>>(
        p, l.first, l.width, level == s.height);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  const TreeLaunchPlan plan = plan_tree_aggregate(s.B * s.tokens, s.E);
  if (!plan.supported) return cudaErrorInvalidValue;
  if (plan.empty) return cudaSuccess;
  detail::tree_aggregate_token_kernel<scalar_t><<<dim3(plan.grid.x, plan.grid.y), dim3(plan.block.x), 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_tree_aggregate_fwd(const TreeAggregateFwdParams& p, cudaStream_t stream) {
  if (!shape_ok(p.s)) return cudaErrorInvalidValue;
  if (p.s.B == 0 || p.s.E == 0) return cudaSuccess;
  if ((p.leaf_values == nullptr && p.s.tokens > 0) || p.leaf_token == nullptr || p.node_padding_mask == nullptr ||
      p.out == nullptr || p.means == nullptr || p.bad == nullptr) {
    return cudaErrorInvalidValue;
  }
  return detail::dispatch_attention_dtype(p.s.dtype, [&](auto scalar) { return fwd<decltype(scalar)>(p, stream); });
}

cudaError_t launch_tree_aggregate_bwd(const TreeAggregateBwdParams& p, cudaStream_t stream) {
  if (!shape_ok(p.s)) return cudaErrorInvalidValue;
  if (p.s.B == 0) return cudaSuccess;
  if (p.grad_nodes == nullptr || p.leaf_token == nullptr || (p.token_leaf == nullptr && p.s.tokens > 0) ||
      p.node_padding_mask == nullptr || (p.grad_values == nullptr && p.s.tokens > 0) || p.shares == nullptr ||
      p.bad == nullptr) {
    return cudaErrorInvalidValue;
  }
  return detail::dispatch_attention_dtype(p.s.dtype, [&](auto scalar) { return bwd<decltype(scalar)>(p, stream); });
}

}  // namespace cuda
}  // namespace attn_ext
