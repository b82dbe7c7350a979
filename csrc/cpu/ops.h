// The CPU kernels of every attn_ext op, as the typed functions csrc/cpu/registration.cpp registers
// for the schemas of csrc/schemas.cpp (the CUDA ones are in csrc/cuda/bindings/ops.h): one
// attn_ext::cpu::<name>_cpu per entry of csrc/op_list.h, which documents each op and its signature.
// Each checks its arguments with the shared checks of csrc/checks/, so both devices fail with the same
// messages. Defined in (by op family):
//   attention      attention_ops.cpp (attention_fwd.cpp, attention_bwd.cpp), merge_states.cpp
//   tree           tree_cross_attention.cpp, tree_cross_attention_bwd.cpp, tree_aggregate.cpp
//   Intention      intention.cpp, sigma_intention.cpp, batched_cholesky.cpp
#pragma once

#include "op_list.h"

namespace attn_ext::cpu {

#define ATTN_EXT_OP(name, return_type, params, schema) ATTN_EXT_UNPAREN return_type name##_cpu params;
#include "op_list.h"

}  // namespace attn_ext::cpu
