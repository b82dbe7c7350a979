// The CUDA kernels of the attn_ext ops, as the typed functions csrc/cuda/bindings/registration.cpp
// registers for the schemas of csrc/schemas.cpp: one attn_ext::cuda::<name>_cuda per entry of
// csrc/op_list.h (sigma_intention_fwd and batched_spd_solve are declared but have no CUDA kernel).
// Each unpacks its tensors into the torch-free launcher's params (csrc/cuda/*.cuh) after the argument
// checks it shares with the CPU op (csrc/checks/). Same results, shapes and dtypes as the CPU ops of
// csrc/cpu/ops.h, for float32, float16 and bfloat16 inputs; attention_fwd/bwd with dropout_p > 0 raise
// NotImplementedError (no dropout in the CUDA kernels). Compiled only against a CUDA build of torch.
// Defined in attention.cpp (attention, cross attention), merge_states.cpp, tree.cpp and intention.cpp.
#pragma once

#include "op_list.h"

namespace attn_ext::cuda {

#define ATTN_EXT_OP(name, return_type, params, schema) ATTN_EXT_UNPAREN return_type name##_cuda params;
#include "op_list.h"

}  // namespace attn_ext::cuda
