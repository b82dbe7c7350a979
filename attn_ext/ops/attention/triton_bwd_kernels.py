"""The two main backward kernels of the attention Triton backend (see :mod:`.triton_bwd`): dK/dV, one
program per key block, and dQ, one program per query block, each recomputing ``P``.

``P = exp(s - lse)`` is recomputed from the saved natural-log ``lse`` with the forward's natural
scores ``s = (q . k) * scale`` (plus the additive mask): the same ``s`` and ``lse = max + log(l)``
as the forward, so ``s - lse`` is exactly 0 for a dominant key even when its score is huge
(~1e30). ``P <= 1``, so a positive ``s - lse`` (the forward's and backward's dots rounding
differently) is clamped to 0. Rows whose ``lse`` is ``-inf`` (no allowed key) and masked pairs
get ``P = 0`` through ``tl.where`` rather than through ``exp(-inf)``, so no ``inf - inf`` is ever
formed and their gradients are 0. A NaN row (``lse`` or ``out`` NaN) is not empty: its ``P`` or
``delta`` is NaN, and so are its gradients and those of the keys it attends to; padded keys are
never loaded and their gradients are stored as 0.

The constexpr flags are the forward's (:mod:`.triton_fwd`): attention mask, causal rule, dropout
(``dV = (P∘Z)ᵀ dO``, ``dS = P ∘ ((dO Vᵀ)∘Z − delta)``, ``Z`` = keep / (1 − p)), and ``GROUP``
query heads per key/value head: a dK/dV program loops over its key block's whole group, so the
group's sum needs no atomics. With the causal rule, a key block starts at its first query and a
query block stops at the diagonal; dQ splits its loop there, so that only the blocks the diagonal
crosses pay for the per-pair causal test (as the forward), while dK/dV tests every pair in one loop
(a second copy of its body cost registers it does not have at D = 128).

``GUARD_ROWS`` (set by ``backward_route`` in :mod:`.triton_bwd` when q or k holds a NaN or inf, for
calls with per-pair rules): the products ``dSᵀ Q`` and ``dS K`` read no operand row through a masked
pair (:func:`~.triton_pairs.pair_dot_into`'s exact product where such a row is not finite). Without it
they are plain GEMMs: a masked pair's weight is 0 and, every row being finite, so is its share.
"""
import triton
import triton.language as tl

from attn_ext.ops.attention.triton_pairs import dropout_keep, pair_dot_into
from attn_ext.ops.attention.triton_score_mod import band_keys, band_queries, scored_pairs
from attn_ext.ops.attention.triton_varlen import entry_offset, sequence
from attn_ext.ops.utils.triton_jit import load_tile, valid_rows


@triton.jit
def _dkdv_query_blocks(
    dk, dv, k, v, q_base, do_base, lse_base, DELTA, attn_base, SEED, row0, lo, hi,
    offs_n, n_ok, offs_d, d_ok, offs_dv, dv_ok, sqm, sqd, sdom, sdod, slm, sam, san, M, N,
    scale, drop_threshold, drop_scale, band_lo, band_hi, softcap, slope, diagonal,
    ATTN_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, PAIR_MASKS: tl.constexpr,
    UPCAST: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """One key block's ``(dk, dv)`` updated by the query blocks ``[lo, hi)`` of one query head, whose rows
    ``row0 + m`` index ``DELTA`` and dropout's counter; ``IS_CAUSAL``, ``WINDOW`` and ``PAIR_MASKS`` are the per-pair
    rules these blocks need."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        q = load_tile(q_base, offs_m, offs_d, sqm, sqd, m_ok, d_ok, UPCAST)
        do = load_tile(do_base, offs_m, offs_dv, sdom, sdod, m_ok, dv_ok, UPCAST)
        lse = tl.load(lse_base + offs_m * slm, mask=m_ok, other=float("-inf"))
        delta = tl.load(DELTA + row0 + offs_m, mask=m_ok, other=0.0)
        row_ok = lse != float("-inf")  # not `>`: a NaN row is not empty, its P is NaN
        lse = tl.where(row_ok, lse, 0.0)

        # Transposed orientation ([keys, queries]) so dv/dk need no transpose of P.
        s_t = tl.dot(k, tl.trans(q), input_precision="ieee") * scale
        s_t, valid, tanh_t = scored_pairs(s_t, attn_base, sam, san, offs_m[None, :], offs_n[:, None],
                                          n_ok[:, None] & m_ok[None, :], band_lo, band_hi, softcap, slope,
                                          diagonal, ATTN_MASK, IS_CAUSAL, WINDOW, SOFTCAP, ALIBI)
        valid = valid & row_ok[None, :]
        x_t = s_t - lse[None, :]
        # `where`, not tl.minimum: a GPU min may drop a NaN row's NaN.
        p_t = tl.where(valid, tl.exp(tl.where(x_t > 0.0, 0.0, x_t)), 0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision="ieee")
        if HAS_DROPOUT:
            keep = dropout_keep(SEED, row0 + offs_m[None, :], offs_n[:, None], N, drop_threshold)
            z = tl.where(keep, drop_scale, 0.0)
            dv += tl.dot((p_t * z).to(do.dtype), do, input_precision="ieee")
            dp_t = dp_t * z
        else:
            dv += tl.dot(p_t.to(do.dtype), do, input_precision="ieee")
        ds_t = tl.where(valid, p_t * (dp_t - delta[None, :]), 0.0)
        if SOFTCAP:
            ds_t = ds_t * (1.0 - tanh_t * tanh_t)  # d(c·tanh(s / c))/ds
        dk = pair_dot_into(dk, ds_t, q, valid, n_ok, m_ok, PAIR_MASKS, BLOCK_M)

    return dk, dv


@triton.jit
def _bwd_dkdv(
    Q, K, V, MASK, ATTN, SEED, DO, LSE, DELTA, DK, DV_OUT,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    smb, smn,
    sab, sah, sam, san,
    sdob, sdoh, sdom, sdod,
    slb, slh, slm,
    sdkb, sdkh, sdkn, sdkd,
    sdvb, sdvh, sdvn, sdvd,
    H, GROUP, M, N, D, DV,
    scale, drop_threshold, drop_scale, band_lo, band_hi, softcap, SLOPES, diagonal, CU_Q, CU_K,
    BLOCK_N_MAX, M_BUCKET, N_BUCKET,
    HAS_MASK: tl.constexpr, ATTN_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    GUARD_ROWS: tl.constexpr, UPCAST: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bkv = tl.program_id(1)  # batch * key/value heads
    HKV = H // GROUP
    off_b = (pid_bkv // HKV).to(tl.int64)
    off_kvh = (pid_bkv % HKV).to(tl.int64)
    # A packed batch (VARLEN): batch entry off_b is a sequence of the packed rows, with its own lengths.
    q_row0, M_rows, k_row0, N_keys, band_lo, band_hi, diagonal = sequence(
        CU_Q, CU_K, off_b, M, N, band_lo, band_hi, diagonal, VARLEN, BOTTOM_RIGHT)
    q_batch = entry_offset(off_b, sqb, q_row0, sqm, VARLEN)
    do_batch = entry_offset(off_b, sdob, q_row0, sdom, VARLEN)
    l_batch = entry_offset(off_b, slb, q_row0, slm, VARLEN)
    k_batch = entry_offset(off_b, skb, k_row0, skn, VARLEN)
    v_batch = entry_offset(off_b, svb, k_row0, svn, VARLEN)
    dk_batch = entry_offset(off_b, sdkb, k_row0, sdkn, VARLEN)
    dv_batch = entry_offset(off_b, sdvb, k_row0, sdvn, VARLEN)
    if VARLEN:
        if pid_n * BLOCK_N >= N_keys:  # past its sequence's end
            return

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    n_in = offs_n < N_keys
    n_ok = valid_rows(MASK, off_b * smb, smn, offs_n, N_keys, HAS_MASK)
    d_ok = offs_d < D
    dv_ok = offs_dv < DV

    k = load_tile(K + k_batch + off_kvh * skh, offs_n, offs_d, skn, skd, n_ok, d_ok, UPCAST)
    v = load_tile(V + v_batch + off_kvh * svh, offs_n, offs_dv, svn, svd, n_ok, dv_ok, UPCAST)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

    lo = 0
    hi = M_rows
    if IS_CAUSAL:
        lo = pid_n * BLOCK_N  # earlier queries see none of these keys
    if WINDOW:
        lo, hi = band_queries(pid_n * BLOCK_N, BLOCK_N, M_rows, band_lo, band_hi, BLOCK_M)
    for g in range(0, GROUP):
        off_h = off_kvh * GROUP + g
        bh = off_b * H + off_h
        row0 = bh * M  # DELTA's and dropout's row of query 0 of this batch entry and head
        if VARLEN:
            row0 = off_h * M + q_row0
        q_base = Q + q_batch + off_h * sqh
        do_base = DO + do_batch + off_h * sdoh
        lse_base = LSE + l_batch + off_h * slh
        attn_base = ATTN + off_b * sab + off_h * sah
        slope = 0.0
        if ALIBI:
            slope = tl.load(SLOPES + bh)
        # One loop, every block testing the causal rule per pair: splitting off the blocks the diagonal crosses
        # (as the forward and dQ do) compiles the body twice, and the second copy's registers made dK/dV spill
        # (D = 128, sm_90, Triton 3.9, 32 x 128 with 8 warps: 80 bytes split, none as one loop).
        dk, dv = _dkdv_query_blocks(
            dk, dv, k, v, q_base, do_base, lse_base, DELTA, attn_base, SEED, row0, lo, hi,
            offs_n, n_ok, offs_d, d_ok, offs_dv, dv_ok, sqm, sqd, sdom, sdod, slm, sam, san, M_rows, N,
            scale, drop_threshold, drop_scale, band_lo, band_hi, softcap, slope, diagonal,
            ATTN_MASK, IS_CAUSAL, HAS_DROPOUT, GUARD_ROWS and (IS_CAUSAL or WINDOW or ATTN_MASK != 0), UPCAST,
            WINDOW, SOFTCAP, ALIBI, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV)

    # Padded keys take no part: 0, also beside a NaN query row (whose 0 * NaN would land here).
    dk = tl.where(n_ok[:, None], dk * scale, 0.0)
    dv = tl.where(n_ok[:, None], dv, 0.0)
    tl.store(DK + dk_batch + off_kvh * sdkh + offs_n[:, None] * sdkn + offs_d[None, :] * sdkd,
             dk.to(DK.dtype.element_ty), mask=n_in[:, None] & d_ok[None, :])
    tl.store(DV_OUT + dv_batch + off_kvh * sdvh + offs_n[:, None] * sdvn + offs_dv[None, :] * sdvd,
             dv.to(DV_OUT.dtype.element_ty), mask=n_in[:, None] & dv_ok[None, :])


@triton.jit
def _dq_key_blocks(
    dq, q, do, lse, delta, row_ok, rows, k_base, v_base, attn_base, MASK, SEED, lo, hi,
    offs_m, m_ok, offs_d, d_ok, offs_dv, dv_ok, mask_row, smn, skn, skd, svn, svd, sam, san, N,
    scale, drop_threshold, drop_scale, band_lo, band_hi, softcap, slope, diagonal,
    HAS_MASK: tl.constexpr, ATTN_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    PAIR_MASKS: tl.constexpr, UPCAST: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """One query block's ``dq`` updated by the key blocks ``[lo, hi)``; ``IS_CAUSAL``, ``WINDOW`` and
    ``PAIR_MASKS`` are the per-pair rules these blocks need."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = valid_rows(MASK, mask_row, smn, offs_n, N, HAS_MASK)
        k = load_tile(k_base, offs_n, offs_d, skn, skd, n_ok, d_ok, UPCAST)
        v = load_tile(v_base, offs_n, offs_dv, svn, svd, n_ok, dv_ok, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s, valid, tanh = scored_pairs(s, attn_base, sam, san, offs_m[:, None], offs_n[None, :],
                                      m_ok[:, None] & n_ok[None, :], band_lo, band_hi, softcap, slope, diagonal,
                                      ATTN_MASK, IS_CAUSAL, WINDOW, SOFTCAP, ALIBI)
        valid = valid & row_ok[:, None]
        x = s - lse[:, None]
        p = tl.where(valid, tl.exp(tl.where(x > 0.0, 0.0, x)), 0.0)  # P <= 1; NaN stays NaN
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        if HAS_DROPOUT:
            keep = dropout_keep(SEED, rows[:, None], offs_n[None, :], N, drop_threshold)
            dp = dp * tl.where(keep, drop_scale, 0.0)
        ds = tl.where(valid, p * (dp - delta[:, None]), 0.0)
        if SOFTCAP:
            ds = ds * (1.0 - tanh * tanh)
        dq = pair_dot_into(dq, ds, k, valid, m_ok, n_ok, PAIR_MASKS, BLOCK_N)

    return dq


@triton.jit
def _bwd_dq(
    Q, K, V, MASK, ATTN, SEED, DO, LSE, DELTA, DQ,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    smb, smn,
    sab, sah, sam, san,
    sdob, sdoh, sdom, sdod,
    slb, slh, slm,
    sdqb, sdqh, sdqm, sdqd,
    H, GROUP, M, N, D, DV,
    scale, drop_threshold, drop_scale, band_lo, band_hi, softcap, SLOPES, diagonal, CU_Q, CU_K,
    BLOCK_N_MAX, M_BUCKET, N_BUCKET,
    HAS_MASK: tl.constexpr, ATTN_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    GUARD_ROWS: tl.constexpr, UPCAST: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if IS_CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m  # the longest query blocks first, as in the forward
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    off_kvh = off_h // GROUP
    # A packed batch (VARLEN): batch entry off_b is a sequence of the packed rows, with its own lengths.
    q_row0, M_rows, k_row0, N_keys, band_lo, band_hi, diagonal = sequence(
        CU_Q, CU_K, off_b, M, N, band_lo, band_hi, diagonal, VARLEN, BOTTOM_RIGHT)
    q_batch = entry_offset(off_b, sqb, q_row0, sqm, VARLEN)
    do_batch = entry_offset(off_b, sdob, q_row0, sdom, VARLEN)
    l_batch = entry_offset(off_b, slb, q_row0, slm, VARLEN)
    dq_batch = entry_offset(off_b, sdqb, q_row0, sdqm, VARLEN)
    k_batch = entry_offset(off_b, skb, k_row0, skn, VARLEN)
    v_batch = entry_offset(off_b, svb, k_row0, svn, VARLEN)
    rows = pid_bh.to(tl.int64) * M  # DELTA's and dropout's row of query 0 of this batch entry and head
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
    q = load_tile(Q + q_batch + off_h * sqh, offs_m, offs_d, sqm, sqd, m_ok, d_ok, UPCAST)
    do = load_tile(DO + do_batch + off_h * sdoh, offs_m, offs_dv, sdom, sdod, m_ok, dv_ok, UPCAST)
    lse = tl.load(LSE + l_batch + off_h * slh + offs_m * slm, mask=m_ok, other=float("-inf"))
    delta = tl.load(DELTA + rows, mask=m_ok, other=0.0)
    row_ok = lse != float("-inf")  # NaN rows included: their gradients are NaN
    lse = tl.where(row_ok, lse, 0.0)

    k_base = K + k_batch + off_kvh * skh
    v_base = V + v_batch + off_kvh * svh
    attn_base = ATTN + off_b * sab + off_h * sah
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    slope = 0.0
    if ALIBI:
        slope = tl.load(SLOPES + pid_bh)

    # As in the forward: key blocks before `full_hi` need no per-pair causal test; a window's blocks all take it.
    hi = N_keys
    full_hi = N_keys
    if IS_CAUSAL:
        hi = tl.minimum(N_keys, (pid_m + 1) * BLOCK_M)
        full_hi = tl.minimum(hi, (pid_m * BLOCK_M // BLOCK_N) * BLOCK_N)
    if WINDOW:
        full_hi, hi = band_keys(pid_m * BLOCK_M, BLOCK_M, N_keys, band_lo, band_hi, BLOCK_N)
    if not WINDOW:
        dq = _dq_key_blocks(
            dq, q, do, lse, delta, row_ok, rows, k_base, v_base, attn_base, MASK, SEED, 0, full_hi,
            offs_m, m_ok, offs_d, d_ok, offs_dv, dv_ok, off_b * smb, smn, skn, skd, svn, svd, sam, san, N_keys,
            scale, drop_threshold, drop_scale, band_lo, band_hi, softcap, slope, diagonal,
            HAS_MASK, ATTN_MASK, False, HAS_DROPOUT, GUARD_ROWS and ATTN_MASK != 0, UPCAST, False, SOFTCAP, ALIBI,
            BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV)
    if IS_CAUSAL or WINDOW:
        dq = _dq_key_blocks(
            dq, q, do, lse, delta, row_ok, rows, k_base, v_base, attn_base, MASK, SEED, full_hi, hi,
            offs_m, m_ok, offs_d, d_ok, offs_dv, dv_ok, off_b * smb, smn, skn, skd, svn, svd, sam, san, N_keys,
            scale, drop_threshold, drop_scale, band_lo, band_hi, softcap, slope, diagonal,
            HAS_MASK, ATTN_MASK, IS_CAUSAL, HAS_DROPOUT, GUARD_ROWS, UPCAST, WINDOW, SOFTCAP, ALIBI,
            BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV)

    dq = dq * scale
    tl.store(DQ + dq_batch + off_h * sdqh + offs_m[:, None] * sdqm + offs_d[None, :] * sdqd,
             dq.to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
