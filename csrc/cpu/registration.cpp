// The CPU kernels of every attn_ext op, registered for the schemas of csrc/schemas.cpp. The CUDA
// kernels are registered the same way, in one file: csrc/cuda/bindings/registration.cpp.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY_IMPL(attn_ext, CPU, m) {
  m.impl("attention_fwd", &attn_ext::cpu::attention_fwd_cpu);
  m.impl("attention_bwd", &attn_ext::cpu::attention_bwd_cpu);
  m.impl("cross_attention_fwd", &attn_ext::cpu::cross_attention_fwd_cpu);
  m.impl("cross_attention_bwd", &attn_ext::cpu::cross_attention_bwd_cpu);
  m.impl("merge_states_fwd", &attn_ext::cpu::merge_states_fwd_cpu);
  m.impl("merge_states_bwd", &attn_ext::cpu::merge_states_bwd_cpu);
  m.impl("tree_cross_attention_fwd", &attn_ext::cpu::tree_cross_attention_fwd_cpu);
  m.impl("tree_cross_attention_bwd", &attn_ext::cpu::tree_cross_attention_bwd_cpu);
  m.impl("tree_aggregate_fwd", &attn_ext::cpu::tree_aggregate_fwd_cpu);
  m.impl("tree_aggregate_bwd", &attn_ext::cpu::tree_aggregate_bwd_cpu);
  m.impl("intention_fwd", &attn_ext::cpu::intention_fwd_cpu);
  m.impl("intention_bwd", &attn_ext::cpu::intention_bwd_cpu);
  m.impl("sigma_intention_fwd", &attn_ext::cpu::sigma_intention_fwd_cpu);
  m.impl("batched_cholesky", &attn_ext::cpu::batched_cholesky_cpu);
  m.impl("batched_cholesky_solve", &attn_ext::cpu::batched_cholesky_solve_cpu);
  m.impl("batched_spd_solve", &attn_ext::cpu::batched_spd_solve_cpu);
}
