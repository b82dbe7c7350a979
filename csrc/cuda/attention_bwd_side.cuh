// The two sides of the backward's dK/dV and dQ kernels (WMMA and mma.sync): a side is the pair (K, V) of a
// key/value head or (Q, dO) of a query head, each a row-major tile at a row offset, and the key padding of
// the (K, V) side. One place computes where their rows start, so both kernel families read the same rows.
#pragma once

#include <cstdint>

#include "attention_bwd.cuh"

namespace attn_ext {
namespace cuda {
namespace detail {

/// Rows r0.. of one side: the first (K or Q) and second (V or dO) tiles, their row strides, and the key
/// padding bytes of the rows (the (K, V) side with a key_padding_mask only, else null).
template <typename scalar_t>
struct BwdSide {
  const scalar_t* first;
  const scalar_t* second;
  int64_t first_stride, second_stride;
  const uint8_t* padding;
};

/// `keys`: the (K, V) side of key/value head `head`, else the (Q, dO) side of query head `head`, of the batch entry
/// or packed sequence `seq` (common/packed_sequences.h), from its row r0.
template <typename scalar_t>
__device__ __forceinline__ BwdSide<scalar_t> bwd_side(const CrossAttentionBwdParams& p, bool keys,
                                                      const SequenceView& seq, int64_t head, int64_t r0) {
  const int64_t b = seq.b;
  const uint8_t* padding = p.key_padding_mask == nullptr ? nullptr : p.key_padding_mask + b * p.mask_stride_b;
  r0 += keys ? seq.k0 : seq.q0;
  BwdSide<scalar_t> side;
  side.first = static_cast<const scalar_t*>(keys ? p.k : p.q) +
               (keys ? b * p.k_stride_b + head * p.k_stride_h + r0 * p.k_stride_n
                     : b * p.q_stride_b + head * p.q_stride_h + r0 * p.q_stride_m);
  side.second = static_cast<const scalar_t*>(keys ? p.v : p.grad_out) +
                (keys ? b * p.v_stride_b + head * p.v_stride_h + r0 * p.v_stride_n
                      : b * p.dout_stride_b + head * p.dout_stride_h + r0 * p.dout_stride_m);
  side.first_stride = keys ? p.k_stride_n : p.q_stride_m;
  side.second_stride = keys ? p.v_stride_n : p.dout_stride_m;
  side.padding = keys && padding != nullptr ? padding + r0 : nullptr;
  return side;
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
