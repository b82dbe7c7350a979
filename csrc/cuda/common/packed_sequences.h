// A packed (varlen) batch as the attention kernels read it: the sequences' row offsets (cu_seqlens) and
// their alignment, and the view one block takes of its sequence. The params structs derive from
// PackedSequences next to QkvLayout and AttentionMaskLayout; left at its defaults (no offsets) a call is the
// dense [B, H, M, ·] batch it always was.
//
// A packed call is laid out as the op takes it: q [1, H, total_q, D], k and v [1, Hkv, total_k, ·], outputs
// and row statistics [1, H, total_q, ·] contiguous; the kernels' B is the number of sequences and their M and
// N the longest sequence's rows and keys (the grid: blocks past their sequence's end return at once). Sequence
// s owns query rows cu_seqlens_q[s] .. cu_seqlens_q[s + 1] and key rows cu_seqlens_k[s] .. cu_seqlens_k[s + 1];
// its band and ALiBi distance are its own: the layout's band sides are relative to the sequence's diagonal,
// which is key m + (N_s − M_s) for query m when bottom_right, else key m.
//
// Plain C++ (no CUDA headers), like the plans; the view is a host and device function.
#pragma once

#include <cstdint>

#include "attn_ext/macros.h"  // ATTN_EXT_HOST_DEVICE

namespace attn_ext {
namespace cuda {

struct PackedSequences {
  /// int32 [B + 1] on the device, from 0, non-decreasing (checked by the binding); null: a dense batch.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  /// The packed rows: the outputs' and statistics' rows per head (cu_seqlens_*[B]).
  int64_t total_q = 0, total_k = 0;
  /// Each sequence's queries sit at the end of its keys (band and ALiBi shifted by N_s − M_s).
  bool bottom_right = false;

  ATTN_EXT_HOST_DEVICE constexpr bool packed() const { return cu_seqlens_q != nullptr; }
};

/// What one block sees of its sequence: where its rows start, how many there are, and how its rows' and
/// heads' outputs are numbered. A dense batch entry b is the view {b, 0, 0, M, N, 0, M, N}.
struct SequenceView {
  int64_t b;         ///< batch index the tensors' batch strides take (0 for a packed batch: one tensor)
  int64_t q0, k0;    ///< the sequence's first query row and key row among the packed rows
  int64_t M, N;      ///< its queries and keys: the bounds of every row and key loop
  int64_t shift;     ///< added to the band's bounded sides and to ALiBi's diagonal (bottom_right: N − M)
  int64_t q_rows, k_rows;  ///< rows per (batch, head) of the outputs and statistics: M, N or total_q, total_k

  /// Row m = 0 of query head h among the [B, H, q_rows] statistics (lse, Δ, dlse) and [·, ·, q_rows, ·]
  /// outputs (out, grad_q).
  ATTN_EXT_HOST_DEVICE int64_t query_row(int64_t H, int64_t h) const { return (b * H + h) * q_rows + q0; }
  /// Key 0 of key/value head h among the [B, Hkv, k_rows, ·] key gradients (grad_k, grad_v).
  ATTN_EXT_HOST_DEVICE int64_t key_row(int64_t Hkv, int64_t h) const { return (b * Hkv + h) * k_rows + k0; }
};

/// Batch entry (or packed sequence) b of a call with M queries and N keys per entry (a packed call: the
/// longest sequence's).
ATTN_EXT_HOST_DEVICE SequenceView sequence_view(const PackedSequences& l, int64_t b, int64_t M, int64_t N) {
  if (!l.packed()) return SequenceView{b, 0, 0, M, N, 0, M, N};
  const int64_t q0 = l.cu_seqlens_q[b], k0 = l.cu_seqlens_k[b];
  const int64_t rows = l.cu_seqlens_q[b + 1] - q0, keys = l.cu_seqlens_k[b + 1] - k0;
  return SequenceView{0, q0, k0, rows, keys, l.bottom_right ? keys - rows : 0, l.total_q, l.total_k};
}

/// Queries, keys and band shift of batch entry (or packed sequence) b alone, as sequence_view gives them: for
/// kernels that ask them again inside their loops rather than hold them in registers (a packed call reads its
/// offsets again, from cache).
ATTN_EXT_HOST_DEVICE int64_t sequence_rows(const PackedSequences& l, int64_t b, int64_t M) {
  return l.packed() ? l.cu_seqlens_q[b + 1] - l.cu_seqlens_q[b] : M;
}
ATTN_EXT_HOST_DEVICE int64_t sequence_keys(const PackedSequences& l, int64_t b, int64_t N) {
  return l.packed() ? l.cu_seqlens_k[b + 1] - l.cu_seqlens_k[b] : N;
}
ATTN_EXT_HOST_DEVICE int64_t sequence_shift(const PackedSequences& l, int64_t b) {
  return l.packed() && l.bottom_right ? sequence_keys(l, b, 0) - sequence_rows(l, b, 0) : 0;
}

}  // namespace cuda
}  // namespace attn_ext
