// Which x86 instruction-set copy of the SIMD kernels to run. Kernels that need their own vector width
// per ISA are compiled once per level (ATTN_EXT_TARGET) and dispatched on isa_level(), rather than
// with target_clones, which compiles one source for all levels: GCC 12 left the AVX2 clone of the
// exponential loop scalar while vectorising the AVX-512 one.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ATTN_EXT_TARGET(arch) __attribute__((target(arch)))
#define ATTN_EXT_X86_KERNELS 1
#else
#define ATTN_EXT_TARGET(arch)
#endif

namespace attn_ext::cpu {

enum class IsaLevel { kBaseline, kAvx2, kAvx512 };

/// The best level this CPU runs (AVX-512 = x86-64-v4, AVX2 = x86-64-v3).
IsaLevel cpu_isa_level();

/// cpu_isa_level() capped by the environment variable ATTN_EXT_CPU_ISA=avx2|baseline if set, read on
/// each call so that tests can run every path on one machine.
IsaLevel isa_level();

/// "avx512", "avx2" or "baseline".
const char* isa_name(IsaLevel level);

}  // namespace attn_ext::cpu
