// The gradient of an additive attention mask (a learned bias) as the CPU backward sums it (attention_bwd.cpp,
// op attention_bwd_bias): each tile's score gradient dS added into the mask's [B, Hq, L, S] view, whose broadcast
// dims (stride 0 in the mask) are kept at size 1, so that a bias shared by the batch or the heads gets a gradient of
// its own size and no [B, H, L, S] buffer exists. The caller makes one thread own each key column.
#pragma once

#include <cstdint>

namespace attn_ext::cpu {

/// The gradient of an additive mask (a learned bias): dS summed into the mask's [B, Hq, L, S] view with its
/// broadcast dims (stride 0) kept at size 1, through these strides (0 along those dims). Null: not wanted.
template <typename acc_t>
struct MaskGradient {
  acc_t* data = nullptr;
  int64_t sb = 0, sh = 0, sm = 0, sn = 0;
  bool wanted() const { return data != nullptr; }
  /// Adds the score gradient tile ds [mt, nc] (leading dim nc) of (b, h), rows m0.., keys n0...
  void add(const acc_t* ds, int64_t b, int64_t h, int64_t m0, int64_t mt, int64_t n0, int64_t nc) const {
    for (int64_t r = 0; r < mt; ++r) {
      acc_t* row = data + b * sb + h * sh + (m0 + r) * sm + n0 * sn;
      const acc_t* d = ds + r * nc;
      if (sn == 1) {
        for (int64_t j = 0; j < nc; ++j) row[j] += d[j];
      } else {
        for (int64_t j = 0; j < nc; ++j) row[j * sn] += d[j];
      }
    }
  }
};

}  // namespace attn_ext::cpu
