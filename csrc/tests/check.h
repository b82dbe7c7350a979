// Minimal checks for the host test binaries: count failures instead of stopping at the first one.
#pragma once

#include <cstdio>

namespace attn_ext_tests {
inline int g_failures = 0;
}  // namespace attn_ext_tests

#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      ++attn_ext_tests::g_failures;                                                 \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
    }                                                                               \
  } while (0)
