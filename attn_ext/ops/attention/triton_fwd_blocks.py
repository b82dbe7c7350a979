"""The attention forward's inner loop (Triton): one query block's online softmax over a range of key blocks, with the
per-pair rules the range needs, the keys read in place or, from a paged cache, through the entry's block table.

Called by the forward kernel (:mod:`.triton_fwd`) for its plain and per-pair loops. With ``PAGED`` (a constexpr:
without it the loop compiles the code it had) the keys' logical indices ``n`` stay what the rules, dropout and
ALiBi read, while K and V rows are loaded from row ``n % PAGE`` of block ``BT_ROW[n // PAGE]`` (the cache's block
and row strides ``skb``/``skn``, ``svb``/``svn``): the cache is never gathered.
"""
from __future__ import annotations

import triton
import triton.language as tl

from attn_ext.ops.attention.triton_pairs import dropout_keep, pair_dot_into
from attn_ext.ops.attention.triton_score_mod import scored_pairs
from attn_ext.ops.utils.triton_jit import load_tile, valid_rows

__all__ = ["attend_key_blocks"]


@triton.jit
def attend_key_blocks(
    acc, l_i, m_i, q, k_base, v_base, attn_base, MASK, SEED, lo, hi,
    offs_m, m_ok, offs_d, d_ok, offs_dv, dv_ok, rows, mask_row, smn, skn, skd, svn, svd, sam, san,
    N, scale, drop_threshold, drop_scale, band_lo, band_hi, softcap, slope, diagonal,
    BT_ROW, PAGE, skb, svb,
    HAS_MASK: tl.constexpr, ATTN_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    PAIR_MASKS: tl.constexpr, GUARD_ROWS: tl.constexpr, UPCAST: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, PAGED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """The online softmax of one query block over the key blocks ``[lo, hi)``: returns the updated
    ``(acc, l_i, m_i)``. ``IS_CAUSAL``, ``WINDOW`` and ``PAIR_MASKS`` are the per-pair rules these blocks need
    (:func:`~.triton_score_mod.scored_pairs` has the window and the score modifications); with
    ``PAIR_MASKS``, ``GUARD_ROWS`` takes the exact product where a masked pair meets a non-finite V row (else
    the plain GEMM, whose poisoned rows the fix-up launch recomputes). ``PAGED``: K and V through the block table
    (see the module's docstring)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = valid_rows(MASK, mask_row, smn, offs_n, N, HAS_MASK)
        if PAGED:
            block = tl.load(BT_ROW + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
            within = (offs_n % PAGE).to(tl.int64)
            kt = load_tile(k_base, offs_d, block * skb + within * skn, skd, 1, d_ok, n_ok, UPCAST)
            v = load_tile(v_base, block * svb + within * svn, offs_dv, 1, svd, n_ok, dv_ok, UPCAST)
        else:
            kt = load_tile(k_base, offs_d, offs_n, skd, skn, d_ok, n_ok, UPCAST)  # Kᵀ: padded keys never loaded
            v = load_tile(v_base, offs_n, offs_dv, svn, svd, n_ok, dv_ok, UPCAST)

        s = tl.dot(q, kt, input_precision="ieee") * scale
        s, allowed, _ = scored_pairs(s, attn_base, sam, san, offs_m[:, None], offs_n[None, :],
                                     m_ok[:, None] & n_ok[None, :], band_lo, band_hi, softcap, slope, diagonal,
                                     ATTN_MASK, IS_CAUSAL, WINDOW, SOFTCAP, ALIBI)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # While a row has seen no valid key its max is -inf; shift by 0 instead
        # so that no (-inf) - (-inf) = NaN appears.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)  # lse and the normaliser are of the undropped weights
        if HAS_DROPOUT:
            keep = dropout_keep(SEED, rows[:, None], offs_n[None, :], N, drop_threshold)
            p = tl.where(keep, p * drop_scale, 0.0)
        acc = pair_dot_into(acc * alpha[:, None], p, v, allowed, m_ok, n_ok, PAIR_MASKS and GUARD_ROWS, BLOCK_N)
        m_i = m_new
    return acc, l_i, m_i
