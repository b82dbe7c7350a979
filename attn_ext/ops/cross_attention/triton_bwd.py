"""Triton backward kernels for chunked cross attention (FlashAttention-2 style).

Three launches, all deterministic (every output element is written by exactly
one program, no atomics):

1. ``_bwd_preprocess``: ``delta_i = dO_i . o_i - dlse_i`` (float32). Folding
   ``dlse`` into delta turns ``dS = P (dP - Delta + dlse)`` into the usual
   ``dS = P (dP - delta)`` so the two main kernels stay oblivious of it.
2. ``_bwd_dkdv``: one program per key block, looping over query blocks.
3. ``_bwd_dq``: one program per query block, looping over key blocks.

``P = exp(s - lse)`` is recomputed from the saved natural-log ``lse`` with
the forward's natural scores ``s = (q . k) * scale`` (see triton_fwd.py):
the same ``s`` and ``lse = max + log(l)`` as the forward, so ``s - lse`` is
exactly 0 for a dominant key even when its score is huge (~1e30), where a
base-2 ``lse`` converted back and forth leaves a residue of ulp(s) ~ 1e23
whose exp is inf. ``P <= 1``, so a positive ``s - lse`` (the forward's and
backward's dots rounding differently) is clamped to 0. Rows whose ``lse`` is ``-inf`` (no valid key) and
padded keys get ``P = 0`` through ``tl.where`` rather than through
``exp(-inf)``, so no ``inf - inf`` is ever formed and their gradients are 0.
A NaN row (``lse`` or ``out`` NaN) is not empty: its ``P`` or ``delta`` is NaN,
and so are its gradients and those of the keys it attends to; padded keys are
never loaded and their gradients are stored as 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_ext.ops.cross_attention.triton_tiles import autotuned, block_d, block_m_interpreted, launch
from attn_ext.ops.utils.triton import check_device, check_dtypes, interpreting, mask_arg
from attn_ext.ops.utils.triton_jit import load_tile, valid_rows
from attn_ext.ops.utils.validation import check_cross_attention_args

__all__ = ["cross_attention_backward"]


@triton.jit
def _bwd_preprocess(
    OUT, DO, DLSE, DELTA,
    sob, soh, som, sod,
    sdob, sdoh, sdom, sdod,
    sgb, sgh, sgm,
    H, M, DV,
    HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < M
    tile_ok = m_ok[:, None] & (offs_dv[None, :] < DV)
    o = tl.load(OUT + off_b * sob + off_h * soh + offs_m[:, None] * som + offs_dv[None, :] * sod,
                mask=tile_ok, other=0.0).to(tl.float32)
    do = tl.load(DO + off_b * sdob + off_h * sdoh + offs_m[:, None] * sdom + offs_dv[None, :] * sdod,
                 mask=tile_ok, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + off_b * sgb + off_h * sgh + offs_m * sgm, mask=m_ok, other=0.0).to(tl.float32)
    # DELTA is a fresh contiguous [B*H, M] buffer.
    tl.store(DELTA + pid_bh.to(tl.int64) * M + offs_m, delta, mask=m_ok)


@triton.jit
def _bwd_dkdv(
    Q, K, V, MASK, DO, LSE, DELTA, DK, DV_OUT,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    smb, smn,
    sdob, sdoh, sdom, sdod,
    slb, slh, slm,
    sdkb, sdkh, sdkn, sdkd,
    sdvb, sdvh, sdvn, sdvd,
    H, M, N, D, DV,
    scale, BLOCK_N_MAX, M_BUCKET, N_BUCKET,
    HAS_MASK: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    n_in = offs_n < N
    n_ok = valid_rows(MASK, off_b * smb, smn, offs_n, N, HAS_MASK)
    d_ok = offs_d < D
    dv_ok = offs_dv < DV

    k = load_tile(K + off_b * skb + off_h * skh, offs_n, offs_d, skn, skd, n_ok, d_ok, UPCAST)
    v = load_tile(V + off_b * svb + off_h * svh, offs_n, offs_dv, svn, svd, n_ok, dv_ok, UPCAST)

    q_base = Q + off_b * sqb + off_h * sqh
    do_base = DO + off_b * sdob + off_h * sdoh
    lse_base = LSE + off_b * slb + off_h * slh
    delta_base = DELTA + pid_bh.to(tl.int64) * M
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

    for start_m in range(0, M, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        q = load_tile(q_base, offs_m, offs_d, sqm, sqd, m_ok, d_ok, UPCAST)
        do = load_tile(do_base, offs_m, offs_dv, sdom, sdod, m_ok, dv_ok, UPCAST)
        lse = tl.load(lse_base + offs_m * slm, mask=m_ok, other=float("-inf"))
        delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
        row_ok = lse != float("-inf")  # not `>`: a NaN row is not empty, its P is NaN
        lse = tl.where(row_ok, lse, 0.0)

        # Transposed orientation ([keys, queries]) so dv/dk need no transpose of P.
        s_t = tl.dot(k, tl.trans(q), input_precision="ieee") * scale
        valid = n_ok[:, None] & row_ok[None, :]
        x_t = s_t - lse[None, :]
        # `where`, not tl.minimum: a GPU min may drop a NaN row's NaN.
        p_t = tl.where(valid, tl.exp(tl.where(x_t > 0.0, 0.0, x_t)), 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision="ieee")
        dp_t = tl.dot(v, tl.trans(do), input_precision="ieee")
        ds_t = tl.where(valid, p_t * (dp_t - delta[None, :]), 0.0)
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision="ieee")

    # Padded keys take no part: 0, also beside a NaN query row (whose 0 * NaN would land here).
    dk = tl.where(n_ok[:, None], dk * scale, 0.0)
    dv = tl.where(n_ok[:, None], dv, 0.0)
    tl.store(DK + off_b * sdkb + off_h * sdkh + offs_n[:, None] * sdkn + offs_d[None, :] * sdkd,
             dk.to(DK.dtype.element_ty), mask=n_in[:, None] & d_ok[None, :])
    tl.store(DV_OUT + off_b * sdvb + off_h * sdvh + offs_n[:, None] * sdvn + offs_dv[None, :] * sdvd,
             dv.to(DV_OUT.dtype.element_ty), mask=n_in[:, None] & dv_ok[None, :])


@triton.jit
def _bwd_dq(
    Q, K, V, MASK, DO, LSE, DELTA, DQ,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    smb, smn,
    sdob, sdoh, sdom, sdod,
    slb, slh, slm,
    sdqb, sdqh, sdqm, sdqd,
    H, M, N, D, DV,
    scale, BLOCK_N_MAX, M_BUCKET, N_BUCKET,
    HAS_MASK: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < M
    d_ok = offs_d < D
    dv_ok = offs_dv < DV

    q = load_tile(Q + off_b * sqb + off_h * sqh, offs_m, offs_d, sqm, sqd, m_ok, d_ok, UPCAST)
    do = load_tile(DO + off_b * sdob + off_h * sdoh, offs_m, offs_dv, sdom, sdod, m_ok, dv_ok, UPCAST)
    lse = tl.load(LSE + off_b * slb + off_h * slh + offs_m * slm, mask=m_ok, other=float("-inf"))
    delta = tl.load(DELTA + pid_bh.to(tl.int64) * M + offs_m, mask=m_ok, other=0.0)
    row_ok = lse != float("-inf")  # NaN rows included: their gradients are NaN
    lse = tl.where(row_ok, lse, 0.0)

    k_base = K + off_b * skb + off_h * skh
    v_base = V + off_b * svb + off_h * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    for start_n in range(0, N, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = valid_rows(MASK, off_b * smb, smn, offs_n, N, HAS_MASK)
        k = load_tile(k_base, offs_n, offs_d, skn, skd, n_ok, d_ok, UPCAST)
        v = load_tile(v_base, offs_n, offs_dv, svn, svd, n_ok, dv_ok, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        valid = row_ok[:, None] & n_ok[None, :]
        x = s - lse[:, None]
        p = tl.where(valid, tl.exp(tl.where(x > 0.0, 0.0, x)), 0.0)  # P <= 1; NaN stays NaN
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = tl.where(valid, p * (dp - delta[:, None]), 0.0)
        dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")

    dq = dq * scale
    tl.store(DQ + off_b * sdqb + off_h * sdqh + offs_m[:, None] * sdqm + offs_d[None, :] * sdqd,
             dq.to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


_bwd_dkdv_tuned = autotuned(_bwd_dkdv)
_bwd_dq_tuned = autotuned(_bwd_dq)


def _has_saturated_rows(lse: torch.Tensor) -> bool:
    from attn_ext.ops.cross_attention.naive import PRECISE_NORMALISER_LSE

    return bool((torch.isfinite(lse) & (lse.abs() >= PRECISE_NORMALISER_LSE)).any())


def cross_attention_backward(grad_out: torch.Tensor, grad_lse: torch.Tensor | None, q: torch.Tensor,
                             k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None,
                             out: torch.Tensor, lse: torch.Tensor, scale: float,
                             chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`cross_attention_forward` (Triton, deterministic).

    Parameters
    ----------
    grad_out : torch.Tensor
        ``[B, H, M, Dv]``, gradient of ``out``, same dtype as q; any strides.
    grad_lse : torch.Tensor or None
        ``[B, H, M]`` gradient of ``lse`` (read as float32; any strides,
        including the stride-0 result of ``expand``). ``None`` means zeros.
    q, k, v : torch.Tensor
        The forward inputs, ``[B, H, M, D]``, ``[B, H, N, D]``,
        ``[B, H, N, Dv]``; one dtype among float32, float16, bfloat16.
    key_padding_mask : torch.Tensor or None
        Bool ``[B, N]``, True marks a padded key.
    out : torch.Tensor
        The forward output ``[B, H, M, Dv]``.
    lse : torch.Tensor
        The forward float32 natural-log log-sum-exp ``[B, H, M]``.
    scale : float
        The forward scale.
    chunk_size : int
        Hint for the key tile ``BLOCK_N``, as in the forward.

    Returns
    -------
    grad_q, grad_k, grad_v : torch.Tensor
        Contiguous, in the dtypes of q, k and v. Padded keys and query rows
        without any valid key get exactly zero gradient; NaN rows get NaN.

    Notes
    -----
    Implements ``dS = P (dO v^T - Delta + dlse)`` with ``Delta = rowsum(dO o)``,
    ``dq = scale dS k``, ``dk = scale dS^T q``, ``dv = P^T dO``, in float32.
    The key-side and query-side gradients come from two separate kernels
    that each recompute ``P``: about 2.5x the forward's FLOPs but no atomics,
    so results are bitwise reproducible run to run.
    """
    check_cross_attention_args(q, k, v, key_padding_mask, scale, chunk_size)
    tensors = [grad_out, q, k, v, out, lse] + ([grad_lse] if grad_lse is not None else [])
    check_device(_bwd_dq, *tensors)
    dtype = check_dtypes(q=q, k=k, v=v)
    B, H, M, D = q.shape
    N, DV = k.shape[2], v.shape[3]
    if tuple(grad_out.shape) != (B, H, M, DV) or tuple(out.shape) != (B, H, M, DV):
        raise ValueError(f"grad_out and out must have shape {(B, H, M, DV)}, "
                         f"got {tuple(grad_out.shape)} and {tuple(out.shape)}")
    if _has_saturated_rows(lse):
        # The kernels rebuild P = exp(s - lse) from the fp32 lse, which at |lse| >= 512 has rounded log(sum)
        # away (tied keys would each get P = 1). Until the forward saves (max, log sum) apart, such calls run
        # the reference backward, which recomputes those rows' normaliser. Costs one host sync per call.
        from attn_ext.ops.cross_attention.naive import cross_attention_backward as reference_backward

        grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
        return tuple(g.contiguous() for g in reference_backward(grad_out, grad_lse, q, k, v, key_padding_mask, out,
                                                                 lse, scale, chunk_size))
    if grad_out.dtype != dtype:
        raise TypeError(f"grad_out must have dtype {dtype}, got {grad_out.dtype}")
    for name, t in (("lse", lse), ("grad_lse", grad_lse)):
        if t is not None and tuple(t.shape) != (B, H, M):
            raise ValueError(f"{name} must have shape {(B, H, M)}, got {tuple(t.shape)}")
    mask, smb, smn, has_mask = mask_arg(key_padding_mask, q)

    grad_q = torch.empty((B, H, M, D), dtype=q.dtype, device=q.device)
    grad_k = torch.empty((B, H, N, D), dtype=k.dtype, device=k.device)
    grad_v = torch.empty((B, H, N, DV), dtype=v.dtype, device=v.device)
    if B * H == 0 or M == 0 or N == 0:
        # Nothing to attend to or from: every gradient is identically zero.
        return grad_q.zero_(), grad_k.zero_(), grad_v.zero_()

    interp = interpreting()
    block_dv = block_d(DV)
    delta = torch.empty((B, H, M), dtype=torch.float32, device=q.device)
    pre_m = block_m_interpreted(M) if interp else 64
    has_dlse = grad_lse is not None
    dlse = grad_lse if has_dlse else lse
    _bwd_preprocess[(triton.cdiv(M, pre_m), B * H)](
        out, grad_out, dlse, delta, *out.stride(), *grad_out.stride(), *dlse.stride(), H, M, DV,
        HAS_DLSE=has_dlse, BLOCK_M=pre_m, BLOCK_DV=block_dv)

    common = (q, k, v, mask, grad_out, lse, delta)
    strides = (*q.stride(), *k.stride(), *v.stride(), smb, smn, *grad_out.stride(), *lse.stride())
    sizes = (H, M, N, D, DV, float(scale))
    meta = dict(HAS_MASK=has_mask, UPCAST=interp, BLOCK_D=block_d(D), BLOCK_DV=block_dv)
    launch(_bwd_dkdv, _bwd_dkdv_tuned, lambda bm, bn: (triton.cdiv(N, bn), B * H),
           (*common, grad_k, grad_v, *strides, *grad_k.stride(), *grad_v.stride(), *sizes),
           meta, M, N, chunk_size)
    launch(_bwd_dq, _bwd_dq_tuned, lambda bm, bn: (triton.cdiv(M, bm), B * H),
           (*common, grad_q, *strides, *grad_q.stride(), *sizes), meta, M, N, chunk_size)
    return grad_q, grad_k, grad_v
