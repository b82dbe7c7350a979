"""Triton forward kernel for chunked cross attention (docs/spec.md §1) and for the general attention op
behind ``scaled_dot_product_attention``: the same kernel, whose constexpr flags add an attention mask,
the causal rule, dropout and grouped key/value heads (all off for cross attention, which then
compiles exactly the code it had; see :mod:`.triton_pairs`).

One program per (query block, batch*head) streams over the keys in blocks of ``BLOCK_N`` with an online
softmax, so no ``[M, N]`` matrix ever exists (a decoding call's keys are split over more programs:
:mod:`.triton_split_keys`). Scores, the running max and ``lse`` are in natural units, exactly as the backward
recomputes them (``dot * scale``), and ``tl.exp`` is applied to the shifted score (on NVIDIA GPUs it lowers to
``ex2.approx`` of ``x * log2(e)``, as fast as an explicit ``exp2``). Keeping them in base 2 (scores scaled by
``scale * log2(e)``) and converting ``lse`` to the natural log and back in the backward does not round trip:
with a huge finite score (~1e30) the backward's ``s - lse`` is a residue of ulp(s) ~ 1e23 instead of 0, whose
exp overflows (non-finite gradients), and with ordinary scores the extra roundings cost the backward accuracy.

With the causal rule a query block stops at the diagonal, about half the work at L = S, and only the
key blocks that the diagonal crosses pay for the per-pair causal test (FlashAttention's split of the
loop); the longest query blocks are launched first.

Tiles and autotuning are those of :mod:`attn_ext.ops.attention.triton_tiles`, shared with
the backward kernels.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from attn_ext.ops.attention.band import Band
from attn_ext.ops.attention.triton_args import check_attention_args
from attn_ext.ops.attention.triton_fwd_tma import launch_forward_tma, tma_forward_unavailable_reason
from attn_ext.ops.attention.triton_fwd_blocks import attend_key_blocks
from attn_ext.ops.attention.triton_pairs import attn_mask_arg, dropout_arg
from attn_ext.ops.attention.triton_score_mod import ScoreArgs, band_keys, kernel_scores, score_args
from attn_ext.ops.attention.triton_split_keys import key_split, merge_parts, part_states
from attn_ext.ops.attention.triton_tiles import autotuned, block_d, launch, launch_fixed
from attn_ext.ops.attention.triton_varlen import (Packed, PagedKeys, check_packed_scores_in_range, entry_offset,
                                                  packed_args, packed_call, packed_scores, sequence)
from attn_ext.ops.utils.triton import check_device, check_dtypes, interpreting, mask_arg
from attn_ext.ops.utils.triton_jit import attention_rows, load_tile
from attn_ext.ops.utils.score_range import check_scores_in_range
from attn_ext.ops.utils.validation import check_cross_attention_args

__all__ = ["attention_forward", "cross_attention_forward", "launch_forward"]


# --------------------------------------------------------------------------- kernel

@triton.jit
def _fwd_kernel(
    Q, K, V, MASK, ATTN, SEED, OUT, LSE, UNSAFE,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    smb, smn,
    sab, sah, sam, san,
    sob, soh, som, sod,
    slb, slh, slm,
    H, GROUP, M, N, D, DV,
    scale, drop_threshold, drop_scale, band_lo, band_hi, softcap, SLOPES, diagonal, CU_Q, CU_K,
    split_base, split_len, sps, spl, BT, sbt, PAGE, skblk, svblk,
    BLOCK_N_MAX, M_BUCKET, N_BUCKET,
    HAS_MASK: tl.constexpr, ATTN_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    GUARD_ROWS: tl.constexpr, UPCAST: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, SPLIT_K: tl.constexpr, PAGED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if IS_CAUSAL:
        # The last query blocks have the most keys below the diagonal: launch them first, so that the
        # grid's tail is made of the short blocks and the SMs finish together.
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    # int64 batch/head offsets: B*H*L*D can exceed 2**31 elements.
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    off_kvh = off_h // GROUP  # GQA: GROUP query heads share a key/value head
    # A packed batch (VARLEN): batch entry off_b is a sequence of the packed rows, with its own lengths.
    q_row0, M_rows, k_row0, N_keys, band_lo, band_hi, diagonal = sequence(
        CU_Q, CU_K, off_b, M, N, band_lo, band_hi, diagonal, VARLEN, BOTTOM_RIGHT)
    q_batch = entry_offset(off_b, sqb, q_row0, sqm, VARLEN)
    k_batch = entry_offset(off_b, skb, k_row0, skn, VARLEN)
    v_batch = entry_offset(off_b, svb, k_row0, svn, VARLEN)
    bt_row = BT
    if PAGED:  # a paged cache (:mod:`.triton_paged`): K and V rows through the entry's row of the block table
        k_batch = 0
        v_batch = 0
        bt_row = BT + off_b * sbt
    o_batch = entry_offset(off_b, sob, q_row0, som, VARLEN)
    l_batch = entry_offset(off_b, slb, q_row0, slm, VARLEN)
    rows = pid_bh.to(tl.int64) * M  # (b·H + h)·M: the first of dropout's counter rows, UNSAFE's index
    if VARLEN:
        if pid_m * BLOCK_M >= M_rows:  # past its sequence's end
            return
        rows = off_h * M + q_row0

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < M_rows
    d_ok = offs_d < D
    dv_ok = offs_dv < DV

    rows = rows + offs_m
    # The fix-up launch (GUARD_ROWS) redoes only the rows the first launch marked in UNSAFE; a block without one
    # loads nothing and runs no loop.
    redo = m_ok
    if GUARD_ROWS:
        redo = m_ok & (tl.load(UNSAFE + rows, mask=m_ok, other=0) != 0)
    q = load_tile(Q + q_batch + off_h * sqh, offs_m, offs_d, sqm, sqd, redo, d_ok, UPCAST)
    k_base = K + k_batch + off_kvh * skh
    v_base = V + v_batch + off_kvh * svh
    attn_base = ATTN + off_b * sab + off_h * sah

    slope = 0.0
    if ALIBI:
        slope = tl.load(SLOPES + pid_bh)  # [B, Hq] contiguous: (b·H + h)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    # Key blocks before `full_hi` lie wholly below the diagonal: every pair of theirs is allowed by the
    # causal rule, so they take the plain loop (no per-pair test, a GEMM for P·V), and only the
    # blocks from `full_hi` to the diagonal pay for the causal test; later key blocks lie wholly
    # above it and are never read. Without the causal rule the first loop covers every key.
    # A window (WINDOW: the band of the call's rules, the causal rule among them) visits only the key blocks its
    # band reaches, one loop testing every pair: a band of a few blocks has few blocks wholly inside it.
    hi = N_keys
    full_hi = N_keys
    if IS_CAUSAL:
        hi = tl.minimum(N_keys, (pid_m + 1) * BLOCK_M)
        full_hi = tl.minimum(hi, (pid_m * BLOCK_M // BLOCK_N) * BLOCK_N)
    if WINDOW:
        full_hi, hi = band_keys(pid_m * BLOCK_M, BLOCK_M, N_keys, band_lo, band_hi, BLOCK_N)
    if GUARD_ROWS:
        if tl.sum(redo.to(tl.int32)) == 0:
            hi = 0
            full_hi = 0
    # The plain loop covers [lo, plain_hi), the per-pair one [full_hi, hi). A split over keys (SPLIT_K, decoding:
    # :mod:`.triton_split_keys`) gives each program of the grid's third axis its part, whose partial state
    # (out, lse) it stores in its own slice of OUT and LSE (sps, spl: their strides between parts) for the merge.
    lo = 0
    plain_hi = full_hi
    if SPLIT_K:
        part = tl.program_id(2)
        lo = split_base + part * split_len
        plain_hi = tl.minimum(full_hi, lo + split_len)
        full_hi = tl.maximum(full_hi, lo)
        hi = tl.minimum(hi, lo + split_len)
        OUT += part.to(tl.int64) * sps
        LSE += part.to(tl.int64) * spl
        UNSAFE += part.to(tl.int64) * spl  # laid out as LSE: a flag per (part, row)
    if not WINDOW:
        acc, l_i, m_i = attend_key_blocks(
            acc, l_i, m_i, q, k_base, v_base, attn_base, MASK, SEED, lo, plain_hi,
            offs_m, m_ok, offs_d, d_ok, offs_dv, dv_ok, rows, off_b * smb, smn, skn, skd, svn, svd, sam, san,
            N_keys, scale, drop_threshold, drop_scale, band_lo, band_hi, softcap, slope, diagonal,
            bt_row, PAGE, skblk, svblk,
            HAS_MASK, ATTN_MASK, False, HAS_DROPOUT, ATTN_MASK != 0, GUARD_ROWS, UPCAST, False, SOFTCAP, ALIBI,
            PAGED, BLOCK_M, BLOCK_N, BLOCK_DV)
    if IS_CAUSAL or WINDOW:
        acc, l_i, m_i = attend_key_blocks(
            acc, l_i, m_i, q, k_base, v_base, attn_base, MASK, SEED, full_hi, hi,
            offs_m, m_ok, offs_d, d_ok, offs_dv, dv_ok, rows, off_b * smb, smn, skn, skd, svn, svd, sam, san,
            N_keys, scale, drop_threshold, drop_scale, band_lo, band_hi, softcap, slope, diagonal,
            bt_row, PAGE, skblk, svblk,
            HAS_MASK, ATTN_MASK, IS_CAUSAL, HAS_DROPOUT, True, GUARD_ROWS, UPCAST, WINDOW, SOFTCAP, ALIBI,
            PAGED, BLOCK_M, BLOCK_N, BLOCK_DV)

    out, lse = attention_rows(acc, l_i, m_i)  # empty rows (0, -inf), NaN rows NaN
    tl.store(OUT + o_batch + off_h * soh + offs_m[:, None] * som + offs_dv[None, :] * sod,
             out.to(OUT.dtype.element_ty), mask=redo[:, None] & dv_ok[None, :])
    tl.store(LSE + l_batch + off_h * slh + offs_m * slm, lse, mask=redo)
    if (ATTN_MASK != 0 or IS_CAUSAL or WINDOW) and not GUARD_ROWS:
        # A masked pair's zero weight times a NaN or inf row of V poisons its row; only a non-finite row can have
        # been, so those are the rows the fix-up launch recomputes (a row that is non-finite by right, e.g. a NaN
        # query, comes out the same).
        unsafe = tl.sum(((out != out) | (tl.abs(out) == float("inf"))).to(tl.int32), 1) > 0
        tl.store(UNSAFE + rows, unsafe.to(tl.int8), mask=m_ok)


_fwd_kernel_tuned = autotuned(_fwd_kernel, "forward")


# --------------------------------------------------------------------------- wrapper

def cross_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            key_padding_mask: torch.Tensor | None, scale: float,
                            chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax cross attention with a fused online softmax (Triton).

    Parameters
    ----------
    q : torch.Tensor
        Queries ``[B, H, M, D]``; any strides.
    k : torch.Tensor
        Keys ``[B, H, N, D]``; any strides.
    v : torch.Tensor
        Values ``[B, H, N, Dv]``; any strides. q, k, v share one dtype among
        float32, float16, bfloat16 (float64 raises ``TypeError``).
    key_padding_mask : torch.Tensor or None
        Bool ``[B, N]``, True marks a padded key that is ignored.
    scale : float
        Multiplier of ``q @ k^T`` before the softmax.
    chunk_size : int
        Hint for the key tile ``BLOCK_N``: the largest power of two not above
        it, clamped to [16, 128] and to N (to 64 under the interpreter, where
        it is used as is; on CUDA it is the upper bound of the tuned tile).

    Returns
    -------
    out : torch.Tensor
        ``[B, H, M, Dv]`` in q's dtype, contiguous. Rows without any key of
        nonzero weight (all padded, or all scores -inf) are 0; rows with a NaN
        score are NaN.
    lse : torch.Tensor
        float32 ``[B, H, M]``, natural-log log-sum-exp of the scaled scores;
        ``-inf`` for those empty rows, NaN for rows with a NaN score.

    Notes
    -----
    Accumulation is float32 and float32 dots use ``input_precision="ieee"`` (no TF32). On CUDA,
    ``BLOCK_M``/``BLOCK_N``/warps/stages are autotuned per (padded D, padded Dv, chunk hint, power-of-two
    buckets of M and N, dtype); under ``TRITON_INTERPRET=1`` a fixed small configuration is used because
    autotuning needs a GPU. Results do not depend on the tiles beyond float rounding.
    """
    # Shapes, mask and scale as for every backend; then what is particular to Triton.
    check_cross_attention_args(q, k, v, key_padding_mask, scale, chunk_size, op="cross_attention")
    out, lse = launch_forward(q, k, v, key_padding_mask, scale, chunk_size)
    check_scores_in_range("cross_attention", q, k, v, out, lse, scale, key_padding_mask=key_padding_mask)
    return out, lse


def launch_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None,
                   scale: float, chunk_size: int, attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                   dropout_p: float = 0.0, dropout_seed: torch.Tensor | None = None,
                   scores: Optional[ScoreArgs] = None, packed: Optional[Packed] = None,
                   key_parts: Optional[int] = None, paged: Optional[PagedKeys] = None):
    """The forward kernel on checked arguments: ``k``, ``v`` may have fewer heads than ``q`` (GQA),
    ``attn_mask`` is a ``[B, Hq, L, S]`` view (bool or q's dtype), ``scores`` the band and score modifications
    (:func:`~.triton_score_mod.score_args`; None: none), ``packed`` a packed batch (:mod:`.triton_varlen`: q, k, v
    ``[1, ·, total, ·]``; the band's sides relative to each sequence's diagonal); ``paged`` its keys read through a
    block table instead (:mod:`.triton_paged`); see :func:`attention_forward`. A decoding-like call splits its
    keys over programs (:mod:`.triton_split_keys`; ``key_parts`` forces a number of parts, for tests)."""
    check_device(_fwd_kernel, q, k, v, *(t for t in (key_padding_mask, attn_mask) if t is not None))
    check_dtypes(q=q, k=k, v=v)
    if scores is None:
        scores = score_args(None, 0.0, None, 0, q.shape[2], k.shape[2], q)
    # The Hopper TMA forward (opt-in, ATTN_EXT_TRITON_TMA=1) for the calls it takes; the same results.
    if (not any(scores.meta.values()) and packed is None
            and tma_forward_unavailable_reason(q, k, v, key_padding_mask, attn_mask, dropout_p) is None):
        return launch_forward_tma(q, k, v, scale, chunk_size, is_causal)
    mask, smb, smn, has_mask = mask_arg(key_padding_mask, q)
    attn, attn_strides, attn_kind = attn_mask_arg(attn_mask, q)
    seed, threshold, drop_scale, has_dropout = dropout_arg(dropout_p, dropout_seed, q)
    cu_args, varlen_meta = packed_args(packed, q)

    B, H, M, D = q.shape
    N, DV = k.shape[2], v.shape[3]
    out = torch.empty((B, H, M, DV), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, M), dtype=torch.float32, device=q.device)
    if lse.numel() == 0:
        return out, lse  # an empty launch grid is an error in Triton
    if has_dropout:
        split = None
    elif packed is None:
        split = key_split(B * H, M, N, q.device, bool(is_causal), scores.window, scores.args[0], scores.args[1],
                          key_parts)
    else:  # the band's sides are relative to each sequence's diagonal: its parts cover every key up to the longest
        split = key_split(packed.sequences * H, packed.max_q, packed.max_k, q.device, False, False, 0, 0, key_parts)
    parts = 1 if split is None else split.parts
    # With per-pair rules, the first launch multiplies whole tiles and marks its non-finite rows (a masked pair
    # meeting a NaN or inf row of V poisons only those); a second, guarded launch recomputes them (16 x 16 tiles;
    # its blocks without a marked row load nothing and run no loop), after the merge of a split's parts.
    pair_rules = attn_kind != 0 or bool(is_causal) or scores.window
    unsafe = torch.empty(parts * B * H * M if pair_rules else 1, dtype=torch.int8, device=q.device)  # all written

    def kernel_args(states, flags: Tensor) -> tuple:
        o, o_strides, lse_t, lse_strides, split_args = states
        return (q, k, v, mask, attn, seed, o, lse_t, flags, *q.stride(), *k.stride(), *v.stride(), smb, smn,
                *attn_strides, *o_strides, *lse_strides, H, H // k.shape[1], M, N, D, DV, float(scale), threshold,
                drop_scale, *scores.args, *cu_args, *split_args, *paged_args)

    states = part_states(split, out, lse)  # the split's float32 partial states, or out and lse themselves
    paged_args = (q, 0, 1, 0, 0) if paged is None else tuple(paged)
    meta = dict(HAS_MASK=has_mask, ATTN_MASK=attn_kind, IS_CAUSAL=bool(is_causal), HAS_DROPOUT=has_dropout,
                GUARD_ROWS=False, UPCAST=interpreting(), **scores.meta, **varlen_meta, SPLIT_K=split is not None,
                PAGED=paged is not None,
                BLOCK_D=block_d(D), BLOCK_DV=block_d(DV))
    # A packed batch: a program per block of the longest sequence, per sequence and head; a split: per part too.
    rows, keys, entries = (M, N, B) if packed is None else (packed.max_q, packed.max_k, packed.sequences)
    grid = lambda meta: (max(1, triton.cdiv(rows, meta["BLOCK_M"])), entries * H, parts)  # noqa: E731
    launch(_fwd_kernel, _fwd_kernel_tuned, grid, kernel_args(states, unsafe), meta, rows, keys, chunk_size)
    if split is not None:
        merge_parts(states[0], states[2], out, lse)
        unsafe = unsafe.view(parts, -1).amax(0) if pair_rules else unsafe  # a row marked by any part
    if pair_rules:  # on the merged rows, over all their keys
        fix_grid = lambda meta: (max(1, triton.cdiv(rows, meta["BLOCK_M"])), entries * H)  # noqa: E731
        launch_fixed(_fwd_kernel, fix_grid, kernel_args(part_states(None, out, lse), unsafe),
                     {**meta, "GUARD_ROWS": True, "SPLIT_K": False}, rows, keys, chunk_size)
    return out, lse


# --------------------------------------------------------------------------- the general op (attention_fwd_triton)


def attention_forward(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
                      key_padding_mask: Optional[Tensor], scale: float, is_causal: bool, dropout_p: float,
                      dropout_seed: Optional[Tensor], chunk_size: int, window_left: int = -1, window_right: int = -1,
                      diagonal: int = 0, softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
                      cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                      bottom_right: bool = False) -> tuple[Tensor, Tensor]:
    """Exact attention with a fused online softmax (Triton).

    Parameters
    ----------
    q, k, v : torch.Tensor
        ``[B, Hq, L, D]``, ``[B, Hkv, S, D]``, ``[B, Hkv, S, Dv]``, any strides, one dtype among
        float32, float16, bfloat16; query head ``h`` reads key/value head ``h // (Hq // Hkv)``.
    attn_mask : torch.Tensor or None
        ``[B, Hq, L, S]`` view (broadcast dims of stride 0 are read as such, never copied): bool,
        True = the pair takes part, or q's dtype, added to the scaled score (``-inf`` masks).
    key_padding_mask : torch.Tensor or None
        Bool ``[B, S]``, True marks a padded key.
    scale : float
        Multiplier of ``q @ k^T``.
    is_causal : bool
        Query ``m`` attends key ``n`` only if ``n <= m + diagonal``.
    dropout_p : float
        Probability in ``[0, 1)`` of dropping a weight (kept weights scaled by ``1 / (1 - p)``).
    dropout_seed : torch.Tensor or None
        int64 one-element tensor, the Philox key; needed when ``dropout_p > 0``.
    chunk_size : int
        Hint for the key tile, as for cross attention.
    window_left, window_right, diagonal : int
        The band of keys about query ``m``'s diagonal key ``m + diagonal`` (:class:`~.band.Band`; ``-1``: no
        limit on that side): only the key blocks the band reaches are read.
    softcap : float
        ``c > 0``: scores ``c·tanh(s / c)`` before the mask; 0: none.
    alibi_slopes : torch.Tensor or None
        float32 ``[B, Hq]``: ``−slope·|m + diagonal − n|`` added to the scores.
    cu_seqlens_q, cu_seqlens_k, bottom_right
        A packed batch (:mod:`.triton_varlen`; checked offsets, ``B = 1``, ``diagonal`` 0, no masks or dropout):
        each sequence attends its own keys, the band aligned per sequence (``bottom_right``: at the end of its
        keys), ``alibi_slopes`` ``[sequences, Hq]``.

    Returns
    -------
    out : torch.Tensor
        ``[B, Hq, L, Dv]`` in q's dtype, contiguous; 0 for rows without an allowed key.
    lse : torch.Tensor
        float32 ``[B, Hq, L]``, log-sum-exp of the masked scaled scores before dropout; ``-inf``
        for those empty rows.
    """
    check_attention_args(q, k, v, attn_mask, key_padding_mask, scale, dropout_p, dropout_seed, chunk_size)
    if cu_seqlens_q is not None:
        packed = packed_call(cu_seqlens_q, cu_seqlens_k, q.shape[2], k.shape[2], bottom_right)
        scores = packed_scores(packed, is_causal, window_left, window_right, softcap, alibi_slopes, q)
        out, lse = launch_forward(q, k, v, None, scale, chunk_size, is_causal=is_causal and not scores.window,
                                  scores=scores, packed=packed)
        check_packed_scores_in_range(q, k, v, out, lse, scale, is_causal, window_left, window_right, packed)
        return out, lse
    band = Band.of(is_causal, window_left, window_right, diagonal)
    scores = kernel_scores(band, is_causal, softcap, alibi_slopes, diagonal, q, k)
    out, lse = launch_forward(q, k, v, key_padding_mask, scale, chunk_size, attn_mask=attn_mask,
                              is_causal=is_causal and not scores.window, dropout_p=float(dropout_p),
                              dropout_seed=dropout_seed, scores=scores)
    check_scores_in_range("scaled_dot_product_attention", q, k, v, out, lse, scale, attn_mask, key_padding_mask,
                          band)
    return out, lse
