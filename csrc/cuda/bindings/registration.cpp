// The CUDA kernels of the attn_ext ops, registered for the schemas of csrc/schemas.cpp in one place,
// as the CPU kernels are in csrc/cpu/registration.cpp. sigma_intention_fwd, batched_spd_solve, attention_bwd_bias and
// paged_attention_fwd have no CUDA kernel; the Python dispatch asks the dispatcher per op which kernels a build holds. The list
// is written out rather than expanded from csrc/op_list.h: it is the record of which ops have a CUDA
// kernel (bench/gpu/build_check.py reads it to check a CUDA build holds them all), and the signatures
// stay single, in op_list.h (the typed functions of ops.h, which the dispatcher checks against the schemas).
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY_IMPL(attn_ext, CUDA, m) {
  m.impl("cross_attention_fwd", &attn_ext::cuda::cross_attention_fwd_cuda);
  m.impl("cross_attention_bwd", &attn_ext::cuda::cross_attention_bwd_cuda);
  m.impl("attention_fwd", &attn_ext::cuda::attention_fwd_cuda);
  m.impl("attention_bwd", &attn_ext::cuda::attention_bwd_cuda);
  m.impl("merge_states_fwd", &attn_ext::cuda::merge_states_fwd_cuda);
  m.impl("merge_states_bwd", &attn_ext::cuda::merge_states_bwd_cuda);
  m.impl("tree_cross_attention_fwd", &attn_ext::cuda::tree_cross_attention_fwd_cuda);
  m.impl("tree_cross_attention_bwd", &attn_ext::cuda::tree_cross_attention_bwd_cuda);
  m.impl("tree_aggregate_fwd", &attn_ext::cuda::tree_aggregate_fwd_cuda);
  m.impl("tree_aggregate_bwd", &attn_ext::cuda::tree_aggregate_bwd_cuda);
  m.impl("intention_fwd", &attn_ext::cuda::intention_fwd_cuda);
  m.impl("intention_bwd", &attn_ext::cuda::intention_bwd_cuda);
  m.impl("batched_cholesky", &attn_ext::cuda::batched_cholesky_cuda);
  m.impl("batched_cholesky_solve", &attn_ext::cuda::batched_cholesky_solve_cuda);
}
