// The operator schemas of attn_ext: one m.def per entry of csrc/op_list.h (where each op's schema and
// C++ signature are written), plus the diagnostics op below. Each device registers its kernels for
// these schemas in one file: csrc/cpu/registration.cpp, and csrc/cuda/bindings/registration.cpp when
// built against a CUDA torch. Python adds the fake (meta) kernels and autograd formulas. Importing the
// extension module (python_module.cpp) runs these static registrations.
#include <torch/library.h>

#include <string>
#include <string_view>

#include "cpu/blas.h"
#include "op_list.h"

namespace {
std::string cpu_gemm_implementation() { return attn_ext::cpu::gemm_implementation(); }
}  // namespace

TORCH_LIBRARY(attn_ext, m) {
  // The schema must name the op of its entry: the registrations use the entry's name.
#define ATTN_EXT_OP(name, return_type, params, schema)                                               \
  static_assert(std::string_view(schema).substr(0, sizeof(#name)) == #name "(",                     \
                "the schema of op " #name " in csrc/op_list.h names another op");                    \
  m.def(schema);
#include "op_list.h"
  // Diagnostics: which GEMM the CPU kernels use in this process (BLAS symbol or portable loops).
  m.def("cpu_gemm_implementation() -> str", &cpu_gemm_implementation);
}
