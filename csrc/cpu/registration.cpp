// The CPU kernels of every attn_ext op (each op of csrc/op_list.h has one), registered for the schemas
// of csrc/schemas.cpp. The CUDA kernels are registered the same way, in one file:
// csrc/cuda/bindings/registration.cpp.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY_IMPL(attn_ext, CPU, m) {
#define ATTN_EXT_OP(name, return_type, params, schema) m.impl(#name, &attn_ext::cpu::name##_cpu);
#include "op_list.h"
}
