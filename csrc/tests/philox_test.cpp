// Host test of attn_ext/philox.h: Random123's known-answer vectors for Philox4x32-10, the dropout
// word's layout of the 64-bit seed and counter, and the keep threshold. Plain C++17, no torch.
// Exit status = number of failed checks, so ctest reports any failure.
#include <cmath>
#include <cstdint>
#include <cstdio>

#include "attn_ext/philox.h"
#include "tests/check.h"

namespace {

void known_answers() {
  // Random123 kat_vectors, philox4x32 with 10 rounds.
  uint32_t zero[4] = {0, 0, 0, 0};
  attn_ext::philox4x32_10(zero, 0, 0);
  CHECK(zero[0] == 0x6627e8d5u && zero[1] == 0xe169c58du && zero[2] == 0xbc57ac4cu && zero[3] == 0x9b00dbd8u);
  uint32_t ones[4] = {0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu};
  attn_ext::philox4x32_10(ones, 0xffffffffu, 0xffffffffu);
  CHECK(ones[0] == 0x408f276du && ones[1] == 0x41c83b0eu && ones[2] == 0xa20bc7c6u && ones[3] == 0x6d5451fdu);
  uint32_t pi[4] = {0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u};
  attn_ext::philox4x32_10(pi, 0xa4093822u, 0x299f31d0u);
  CHECK(pi[0] == 0xd16cfe09u && pi[1] == 0x94fdccebu && pi[2] == 0x5001e420u && pi[3] == 0x24126ea1u);
}

void dropout_word_layout() {
  // Seed low word is key 0, high word key 1; counter low word is c0, high word c1.
  CHECK(attn_ext::philox_dropout_word(0, 0) == 0x6627e8d5u);
  uint32_t c[4] = {0x89abcdefu, 0x01234567u, 0, 0};
  attn_ext::philox4x32_10(c, 0x9abcdef0u, 0x12345678u);
  CHECK(attn_ext::philox_dropout_word(0x123456789abcdef0ull, 0x0123456789abcdefull) == c[0]);
  // A negative int64 seed is its two's complement bits.
  uint32_t d[4] = {7, 0, 0, 0};
  attn_ext::philox4x32_10(d, 0xffffffffu, 0xffffffffu);
  CHECK(attn_ext::philox_dropout_word(static_cast<uint64_t>(int64_t(-1)), 7) == d[0]);
  CHECK(attn_ext::dropout_counter(1, 2, 3, 4, 5, 6, 7) == ((1ull * 5 + 2) * 6 + 3) * 7 + 4);
}

void thresholds_and_rate() {
  CHECK(attn_ext::dropout_threshold(0.0) == 0u);
  CHECK(attn_ext::dropout_threshold(0.5) == 0x80000000u);
  CHECK(attn_ext::dropout_threshold(0.25) == 0x40000000u);
  CHECK(attn_ext::dropout_threshold(0.75 + std::ldexp(1.0, -33)) == 0xC0000000u);  // floor, not round
  CHECK(attn_ext::dropout_threshold(1.0 - std::ldexp(1.0, -40)) == 0xFFFFFFFFu);
  CHECK(attn_ext::dropout_threshold(1e-10) == 0u);  // floor(0.43)
  // Keep rate over a run of counters is 1 - p within 5 standard deviations.
  const double p = 0.3;
  const uint32_t t = attn_ext::dropout_threshold(p);
  const int n = 200000;
  int kept = 0;
  for (int e = 0; e < n; ++e) kept += attn_ext::philox_dropout_word(12345, e) >= t ? 1 : 0;
  const double rate = double(kept) / n, sd = std::sqrt(p * (1 - p) / n);
  CHECK(std::fabs(rate - (1 - p)) < 5 * sd);
}

}  // namespace

int main() {
  known_answers();
  dropout_word_layout();
  thresholds_and_rate();
  if (attn_ext_tests::g_failures) std::fprintf(stderr, "%d failed checks\n", attn_ext_tests::g_failures);
  else std::printf("philox tests passed\n");
  return attn_ext_tests::g_failures > 100 ? 100 : attn_ext_tests::g_failures;
}
