// Counter-based dropout of the attention kernels: Philox4x32-10 (Salmon et al., "Parallel random
// numbers: as easy as 1, 2, 3", SC 2011), shared by the CPU and CUDA kernels so that every backend
// drops the same (batch, head, query, key) pairs and the backward regenerates the forward's choice
// instead of storing a mask. Plain C++ (no torch), callable from host and device code.
//
// The word of a pair is output 0 of Philox4x32-10 with key (seed low 32 bits, seed high 32 bits)
// and counter (e low, e high, 0, 0), e = ((b·Hq + h)·L + m)·S + n: the same stream as Triton's
// tl.randint(seed, offset) for an int64 offset, so a Triton kernel draws the same words.
#pragma once

#include <stdint.h>

#include "attn_ext/macros.h"

namespace attn_ext {

constexpr uint32_t kPhiloxMulA = 0xD2511F53u;  // multiplies counter word 0
constexpr uint32_t kPhiloxMulB = 0xCD9E8D57u;  // multiplies counter word 2
constexpr uint32_t kPhiloxWeylA = 0x9E3779B9u;  // key 0 increment (golden ratio)
constexpr uint32_t kPhiloxWeylB = 0xBB67AE85u;  // key 1 increment (sqrt(3) - 1)

/// High 32 bits of the 64-bit product a·b.
ATTN_EXT_HOST_DEVICE uint32_t philox_mulhi(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

/// The four output words of Philox4x32-10 for `counter` under `key`, written back into `counter`.
ATTN_EXT_HOST_DEVICE void philox4x32_10(uint32_t counter[4], uint32_t k0, uint32_t k1) {
  uint32_t c0 = counter[0], c1 = counter[1], c2 = counter[2], c3 = counter[3];
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi_a = philox_mulhi(kPhiloxMulA, c0), lo_a = kPhiloxMulA * c0;
    const uint32_t hi_b = philox_mulhi(kPhiloxMulB, c2), lo_b = kPhiloxMulB * c2;
    c0 = hi_b ^ c1 ^ k0;
    c2 = hi_a ^ c3 ^ k1;
    c1 = lo_b;
    c3 = lo_a;
    k0 += kPhiloxWeylA;
    k1 += kPhiloxWeylB;
  }
  counter[0] = c0, counter[1] = c1, counter[2] = c2, counter[3] = c3;
}

/// The dropout word of the pair with counter `e` (see the file comment) under the 64-bit `seed`.
ATTN_EXT_HOST_DEVICE uint32_t philox_dropout_word(uint64_t seed, uint64_t e) {
  uint32_t counter[4] = {static_cast<uint32_t>(e), static_cast<uint32_t>(e >> 32), 0u, 0u};
  philox4x32_10(counter, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return counter[0];
}

/// floor(p · 2^32) for a drop probability p in [0, 1): a pair is kept iff its word is ≥ this, i.e.
/// with probability 1 − threshold / 2^32, which rounds p by less than 2^-32. Computed in double,
/// where p · 2^32 is exact.
ATTN_EXT_HOST_DEVICE uint32_t dropout_threshold(double p) {
  const double scaled = p * 4294967296.0;
  if (!(scaled > 0.0)) return 0u;
  return scaled >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(scaled);
}

/// Counter of pair (b, h, m, n) for Hq query heads, L queries and S keys.
ATTN_EXT_HOST_DEVICE uint64_t dropout_counter(uint64_t b, uint64_t h, uint64_t m, uint64_t n, uint64_t Hq, uint64_t L,
                                              uint64_t S) {
  return ((b * Hq + h) * L + m) * S + n;
}

}  // namespace attn_ext
