#include "isa_level.h"

#include <cstdlib>
#include <cstring>

namespace attn_ext::cpu {

IsaLevel cpu_isa_level() {
#ifdef ATTN_EXT_X86_KERNELS
  static const IsaLevel cpu = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("x86-64-v4")   ? IsaLevel::kAvx512
           : __builtin_cpu_supports("x86-64-v3") ? IsaLevel::kAvx2
                                                 : IsaLevel::kBaseline;
  }();
  return cpu;
#else
  return IsaLevel::kBaseline;
#endif
}

IsaLevel isa_level() {
  const IsaLevel cpu = cpu_isa_level();
  const char* cap = std::getenv("ATTN_EXT_CPU_ISA");
  if (cap != nullptr && std::strcmp(cap, "baseline") == 0) return IsaLevel::kBaseline;
  if (cap != nullptr && std::strcmp(cap, "avx2") == 0 && cpu == IsaLevel::kAvx512) return IsaLevel::kAvx2;
  return cpu;
}

const char* isa_name(IsaLevel level) {
  switch (level) {
    case IsaLevel::kAvx512: return "avx512";
    case IsaLevel::kAvx2: return "avx2";
    default: return "baseline";
  }
}

}  // namespace attn_ext::cpu
