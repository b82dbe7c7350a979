"""The packed (varlen) batch of the attention Triton kernels: ``q [1, H, total_q, D]``, ``k, v [1, Hkv, total_k, ·]``
and int32 ``cu_seqlens_q/k [S + 1]``, sequence ``s``'s query rows ``cu_q[s] .. cu_q[s + 1]`` attending its key rows
``cu_k[s] .. cu_k[s + 1]`` only (FlashAttention's ``varlen`` layout, the cpp kernels' segments).

One launch covers every sequence: the grid's batch axis runs over the sequences (``S · H`` programs of a query or
key block each, the block axis sized by the longest sequence), and each program reads its sequence's offsets and
lengths, then works as on one batch entry of those lengths; programs past their sequence's end return at once. No
padding is formed and each sequence's work follows its own lengths. Under ``VARLEN`` (a constexpr; without it the
kernels compile the code they had) the band's sides come relative to each sequence's diagonal
(``BOTTOM_RIGHT``: ``keys − rows``, else 0), which ALiBi's distances use too.
"""
from typing import List, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from attn_ext.ops.attention.band import Band
from attn_ext.ops.attention.packed import segments
from attn_ext.ops.attention.triton_score_mod import score_args
from attn_ext.ops.utils.score_range import check_scores_in_range

__all__ = ["Packed", "PagedKeys", "check_packed_scores_in_range", "entry_offset", "packed_args", "packed_call", "packed_scores",
           "sequence"]


@triton.jit
def sequence(CU_Q, CU_K, seq, M, N, band_lo, band_hi, diagonal, VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr):
    """``(q_row0, rows, k_row0, keys, band_lo, band_hi, diagonal)`` of batch entry or packed sequence ``seq``: its
    first query and key rows among the packed ones (0 without ``VARLEN``), its lengths (``M``, ``N``) and its band
    sides and ALiBi diagonal (the call's, or relative ones moved to the sequence's diagonal)."""
    q_row0 = 0
    k_row0 = 0
    rows = M
    keys = N
    if VARLEN:
        q_row0 = tl.load(CU_Q + seq)
        rows = tl.load(CU_Q + seq + 1) - q_row0
        k_row0 = tl.load(CU_K + seq)
        keys = tl.load(CU_K + seq + 1) - k_row0
        diagonal = 0
        if BOTTOM_RIGHT:
            diagonal = keys - rows
        band_lo = band_lo + diagonal
        band_hi = band_hi + diagonal
    return q_row0, rows, k_row0, keys, band_lo, band_hi, diagonal


@triton.jit
def entry_offset(entry, entry_stride, row0, row_stride, VARLEN: tl.constexpr):
    """Where a batch entry of a tensor starts: ``entry · entry_stride``, or with ``VARLEN`` (one batch entry of
    packed rows) where the sequence's first row ``row0`` is."""
    if VARLEN:
        return row0.to(tl.int64) * row_stride
    return entry * entry_stride


class Packed(NamedTuple):
    """A packed batch as the launchers take it: the offsets (int32, on the tensors' device), their host copy
    ``[(q0, q1, k0, k1)]`` per sequence, the longest sequences' lengths and the alignment."""
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    segments: List[Tuple[int, int, int, int]]
    max_q: int
    max_k: int
    bottom_right: bool

    @property
    def sequences(self) -> int:
        return len(self.segments)


class PagedKeys(NamedTuple):
    """A packed batch's keys read from a paged cache (:mod:`.triton_paged`) as the forward kernel takes them: the
    block table ``[S, max_blocks]`` (int32), its row stride, the block size, and the K and V caches' block strides
    (their row, head and feature strides are those of the ``k``, ``v`` views the kernel gets)."""
    block_table: torch.Tensor
    table_stride: int
    block_size: int
    k_block_stride: int
    v_block_stride: int


def packed_args(packed: Optional[Packed], fallback: torch.Tensor) -> tuple:
    """``(CU_Q, CU_K)`` kernel arguments (``fallback`` twice, never read, without a packed batch) and the
    constexprs ``VARLEN``, ``BOTTOM_RIGHT``."""
    if packed is None:
        return (fallback, fallback), dict(VARLEN=False, BOTTOM_RIGHT=False)
    return (packed.cu_q, packed.cu_k), dict(VARLEN=True, BOTTOM_RIGHT=bool(packed.bottom_right))


def packed_call(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int, bottom_right: bool) -> Packed:
    """The :class:`Packed` of a call's offsets, checked (:func:`~.packed.segments`, named errors) with the one host
    copy that also gives the longest lengths."""
    segs = segments(cu_q, cu_k, total_q, total_k)
    max_q = max((q1 - q0 for q0, q1, _, _ in segs), default=0)
    max_k = max((k1 - k0 for _, _, k0, k1 in segs), default=0)
    return Packed(cu_q.contiguous(), cu_k.contiguous(), segs, max_q, max_k, bool(bottom_right))


def packed_scores(packed: Packed, is_causal: bool, window_left: int, window_right: int, softcap: float,
                  alibi_slopes: Optional[torch.Tensor], fallback: torch.Tensor):
    """The kernels' band and score arguments of a packed call: the band's sides relative to each sequence's
    diagonal, clamped so that no side moved by a diagonal crosses a sequence (an unbounded side stays unbounded).
    The top-left causal rule stays ``IS_CAUSAL``; the bottom-right one is a ``WINDOW``."""
    band = Band.of(is_causal, window_left, window_right, 0)
    window = band.active and (band != Band.of(is_causal) or packed.bottom_right)
    reach = packed.max_q + packed.max_k + 1
    return score_args(band if window else None, softcap, alibi_slopes, 0, reach, reach, fallback)


def check_packed_scores_in_range(q, k, v, out, lse, scale, is_causal, window_left, window_right,
                                 packed: Packed) -> None:
    """:func:`check_scores_in_range` per sequence of a packed batch (on the host's tensors only, as it)."""
    if lse.device.type != "cpu":
        return
    for q0, q1, k0, k1 in packed.segments:
        diag = (k1 - k0) - (q1 - q0) if packed.bottom_right else 0
        check_scores_in_range("varlen_attention", q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], out[:, :, q0:q1],
                              lse[:, :, q0:q1], scale, band=Band.of(is_causal, window_left, window_right, diag))

