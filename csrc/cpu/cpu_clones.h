// The extension is built for the baseline x86-64 ISA so that it loads anywhere; hot loops marked
// ATTN_EXT_CPU_CLONES get AVX2 and AVX-512 clones that the loader selects for the running CPU (GNU ifunc).
#pragma once

#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define ATTN_EXT_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ATTN_EXT_CPU_CLONES
#endif
