"""The attention backward for Hopper (sm_90): dK/dV and dQ with Q, K, V and dO loaded and the gradients stored
through TMA tensor descriptors. Opt-in with the TMA forward (``ATTN_EXT_TRITON_TMA=1``) until a GPU has measured
it; :func:`tma_backward_unavailable_reason` says why a call cannot take it, and ``launch_backward``
(:mod:`.triton_bwd`) then runs the general kernels. The preprocess (``delta``) is the general backward's.

The common path only, as the TMA forward: fp16/bf16, no key padding mask, no attention mask, no dropout; the
causal rule (top-left) or none; grouped key/value heads (a dK/dV program sums its group, no atomics). The
general kernels' conventions (:mod:`.triton_bwd_kernels`): ``P = exp(s - lse)`` from the saved natural-log
``lse`` clamped to 1, empty rows (``lse = -inf``) and masked pairs give 0 through ``where``, NaN rows stay NaN,
and, where q or k holds a NaN or inf (``GUARD_ROWS``), no operand row is read through a pair above the diagonal
(the exact product of :func:`~.triton_pairs.causal_dot_into` when such a row is not finite).

TMA fills the rows of a box past ``M`` or ``N`` with zeros and drops them on the store: a dK/dV program's
query tail needs no mask (a zero ``dO`` row and an ``lse`` of ``-inf`` give it no weight), and only dQ's last
key block tests its keys against ``N``. No loop is warp-specialised: Triton specialises loops whose body is
one MMA chain and softmax, and each of these has two dependent products on the recomputed ``P``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from attn_ext.ops.attention.triton_fwd_tma import (ensure_allocator, tma_forward_unavailable_reason, tma_ready,
                                                   within_problem)
from attn_ext.ops.attention.triton_pairs import all_finite, causal_dot_into
from attn_ext.ops.attention.triton_spills import device_arch, spill_free_configs
from attn_ext.ops.attention.triton_tiles import block_d, launch
from attn_ext.ops.utils.triton import interpreting, lazily_autotuned
from attn_ext.ops.utils.triton_jit import load_box, rows_descriptor

__all__ = ["TMA_BWD_TILES", "launch_backward_tma", "tma_backward_unavailable_reason"]


# --------------------------------------------------------------------------- kernels

@triton.jit
def _dkdv_tma_query_blocks(dk, dv, k, v, q_desc, do_desc, lse_base, slm, delta_base, lo, hi, offs_n, M,
                           scale, CAUSAL_PAIRS: tl.constexpr, GUARD_ROWS: tl.constexpr, UPCAST: tl.constexpr,
                           BLOCK_M: tl.constexpr):
    """One key block's ``(dk, dv)`` updated by one query head's query blocks ``[lo, hi)``; ``CAUSAL_PAIRS``:
    these blocks may hold pairs above the diagonal; ``GUARD_ROWS``: a query row may be non-finite."""
    for start_m in tl.range(lo, hi, BLOCK_M):
        q = load_box(q_desc, start_m, UPCAST)
        do = load_box(do_desc, start_m, UPCAST)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        lse = tl.load(lse_base + offs_m * slm, mask=m_ok, other=float("-inf"))
        delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
        valid = (lse != float("-inf"))[None, :]  # not `>`: a NaN row is not empty, its P is NaN
        lse = tl.where(lse != float("-inf"), lse, 0.0)
        if CAUSAL_PAIRS:
            valid = valid & (offs_n[:, None] <= offs_m[None, :])
        # Transposed orientation ([keys, queries]): dV and dK need no transpose of P.
        x_t = tl.dot(k, tl.trans(q), input_precision="ieee") * scale - lse[None, :]
        p_t = tl.where(valid, tl.exp(tl.where(x_t > 0.0, 0.0, x_t)), 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision="ieee")
        dp_t = tl.dot(v, tl.trans(do), input_precision="ieee")
        ds_t = tl.where(valid, p_t * (dp_t - delta[None, :]), 0.0)
        if CAUSAL_PAIRS and GUARD_ROWS:
            dk = causal_dot_into(dk, ds_t, q, offs_n, start_m, M, True, BLOCK_M)
        else:
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision="ieee")
    return dk, dv


@triton.jit
def _bwd_dkdv_tma_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV_OUT,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdom, slb, slh, slm,
    H, GROUP, M, N, D, DV, scale, BLOCK_N_MAX, M_BUCKET, N_BUCKET,
    IS_CAUSAL: tl.constexpr, GUARD_ROWS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bkv = tl.program_id(1)  # batch * key/value heads
    HKV = H // GROUP
    off_b = (pid_bkv // HKV).to(tl.int64)
    off_kvh = (pid_bkv % HKV).to(tl.int64)
    k = load_box(rows_descriptor(K + off_b * skb + off_kvh * skh, N, D, skn, BLOCK_N, BLOCK_D), pid_n * BLOCK_N, UPCAST)
    v = load_box(rows_descriptor(V + off_b * svb + off_kvh * svh, N, DV, svn, BLOCK_N, BLOCK_DV), pid_n * BLOCK_N,
                 UPCAST)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

    lo = 0
    if IS_CAUSAL:
        lo = pid_n * BLOCK_N  # earlier queries see none of these keys
    for g in range(0, GROUP):
        off_h = off_kvh * GROUP + g
        q_desc = rows_descriptor(Q + off_b * sqb + off_h * sqh, M, D, sqm, BLOCK_M, BLOCK_D)
        do_desc = rows_descriptor(DO + off_b * sdob + off_h * sdoh, M, DV, sdom, BLOCK_M, BLOCK_DV)
        lse_base = LSE + off_b * slb + off_h * slh
        delta_base = DELTA + (off_b * H + off_h) * M
        # One loop testing the causal rule in every block, as the general dK/dV kernel (one copy of the body).
        dk, dv = _dkdv_tma_query_blocks(dk, dv, k, v, q_desc, do_desc, lse_base, slm, delta_base, lo, M,
                                        offs_n, M, scale, IS_CAUSAL, GUARD_ROWS, UPCAST, BLOCK_M)

    # DK and DV are fresh contiguous [B, HKV, N, D] buffers; TMA drops the rows past N.
    dk_desc = rows_descriptor(DK + pid_bkv.to(tl.int64) * N * D, N, D, D, BLOCK_N, BLOCK_D)
    dv_desc = rows_descriptor(DV_OUT + pid_bkv.to(tl.int64) * N * DV, N, DV, DV, BLOCK_N, BLOCK_DV)
    dk_desc.store([pid_n * BLOCK_N, 0], (dk * scale).to(DK.dtype.element_ty))
    dv_desc.store([pid_n * BLOCK_N, 0], dv.to(DV_OUT.dtype.element_ty))


@triton.jit
def _dq_tma_key_blocks(dq, q, do, lse, delta, row_ok, k_desc, v_desc, lo, hi, offs_m, m_ok, N, scale,
                       MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, GUARD_ROWS: tl.constexpr, UPCAST: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """One query block's ``dq`` updated by the key blocks ``[lo, hi)``. ``MASKED``: these blocks hold keys past
    ``N`` or (``IS_CAUSAL``) pairs above the diagonal, whose weights are 0 and whose key rows are read through
    :func:`~.triton_pairs.causal_dot_into`'s guard."""
    for start_n in tl.range(lo, hi, BLOCK_N):
        k = load_box(k_desc, start_n, UPCAST)
        v = load_box(v_desc, start_n, UPCAST)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        valid = row_ok[:, None]
        if MASKED:
            valid = valid & n_ok[None, :]
            if IS_CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None])
        x = tl.dot(q, tl.trans(k), input_precision="ieee") * scale - lse[:, None]
        p = tl.where(valid, tl.exp(tl.where(x > 0.0, 0.0, x)), 0.0)  # P <= 1; NaN stays NaN
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = tl.where(valid, p * (dp - delta[:, None]), 0.0)
        # Keys past N are zero rows (TMA's fill): only pairs above the diagonal may meet a non-finite one.
        if MASKED and IS_CAUSAL and GUARD_ROWS:
            dq = causal_dot_into(dq, ds, k, offs_m, start_n, N, False, BLOCK_N)
        else:
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision="ieee")
    return dq


@triton.jit
def _bwd_dq_tma_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdom, slb, slh, slm,
    H, GROUP, M, N, D, DV, scale, BLOCK_N_MAX, M_BUCKET, N_BUCKET,
    IS_CAUSAL: tl.constexpr, GUARD_ROWS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if IS_CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m  # the longest query blocks first, as the forward
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    off_kvh = off_h // GROUP
    k_desc = rows_descriptor(K + off_b * skb + off_kvh * skh, N, D, skn, BLOCK_N, BLOCK_D)
    v_desc = rows_descriptor(V + off_b * svb + off_kvh * svh, N, DV, svn, BLOCK_N, BLOCK_DV)
    q = load_box(rows_descriptor(Q + off_b * sqb + off_h * sqh, M, D, sqm, BLOCK_M, BLOCK_D), pid_m * BLOCK_M, UPCAST)
    do = load_box(rows_descriptor(DO + off_b * sdob + off_h * sdoh, M, DV, sdom, BLOCK_M, BLOCK_DV), pid_m * BLOCK_M,
                  UPCAST)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    lse = tl.load(LSE + off_b * slb + off_h * slh + offs_m * slm, mask=m_ok, other=float("-inf"))
    delta = tl.load(DELTA + pid_bh.to(tl.int64) * M + offs_m, mask=m_ok, other=0.0)
    row_ok = lse != float("-inf")  # NaN rows included: their gradients are NaN
    lse = tl.where(row_ok, lse, 0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Whole key blocks wholly below the diagonal (all of them without the causal rule) take the plain loop;
    # from `full_hi` to `hi`, the blocks the diagonal crosses and a last, partial key block test each pair.
    hi = N
    full_hi = (N // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        hi = tl.minimum(N, (pid_m + 1) * BLOCK_M)
        full_hi = tl.minimum(full_hi, (pid_m * BLOCK_M // BLOCK_N) * BLOCK_N)
    dq = _dq_tma_key_blocks(dq, q, do, lse, delta, row_ok, k_desc, v_desc, 0, full_hi, offs_m, m_ok, N, scale,
                            False, False, GUARD_ROWS, UPCAST, BLOCK_N)
    dq = _dq_tma_key_blocks(dq, q, do, lse, delta, row_ok, k_desc, v_desc, full_hi, hi, offs_m, m_ok, N, scale,
                            True, IS_CAUSAL, GUARD_ROWS, UPCAST, BLOCK_N)

    dq_desc = rows_descriptor(DQ + pid_bh.to(tl.int64) * M * D, M, D, D, BLOCK_M, BLOCK_D)
    dq_desc.store([pid_m * BLOCK_M, 0], (dq * scale).to(DQ.dtype.element_ty))


# --------------------------------------------------------------------------- tiles

#: (BLOCK_M, BLOCK_N, num_warps, num_stages) of each kernel. wgmma takes 64 rows per warpgroup of the MMA's row
#: tile: dK/dV's keys (BLOCK_N >= 64), dQ's queries (BLOCK_M >= 64); a narrower one compiles to mma.sync. dK/dV's
#: last three (8 warps, 2 stages: 32 x 128, 32 x 64, 16 x 128) are those spill-free under the causal rule at
#: D = 128 with Triton 3.6 as well as 3.9 (223-238 registers), where 3.6 spills 8 bytes and more in the others. The
#: pruning drops the configs that spill for the call's head dims and causal rule, as the AOT table of
#: :mod:`.spill_tables` measured them (:func:`~.triton_spills.spill_free_configs`).
TMA_BWD_TILES = {
    "dkdv": ((64, 64, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2), (128, 64, 8, 2), (64, 128, 8, 2), (32, 128, 8, 2),
             (32, 64, 8, 2), (16, 128, 8, 2)),
    "dq": ((64, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2), (64, 128, 8, 2)),
}
#: Spill-free for both kernels at D = 64 and 128, with the causal rule and without (Triton 3.9).
_PINNED = ((("BLOCK_M", 64), ("BLOCK_N", 64)), 8, 2)
_TUNE_KEY = ["BLOCK_D", "BLOCK_DV", "BLOCK_N_MAX", "M_BUCKET", "N_BUCKET", "IS_CAUSAL", "GUARD_ROWS"]


def _configs(kind: str) -> list:
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in TMA_BWD_TILES[kind]]


def _pruning(kernel_name: str):
    def prune(configs, named_args, **kwargs):
        """Keep the configs within the chunk-size hint and the problem size (every one fits sm_90's shared
        memory: at most two resident [128, D] tiles and two stages of two streamed [64, D] tiles at D = 128),
        then those the AOT table says do not spill on this card."""
        kept = [c for c in configs if within_problem(c, named_args)]
        if not kept:
            return configs[:1]
        return spill_free_configs(kept, kernel_name, device_arch(), named_args["Q"].element_size(), kwargs["BLOCK_D"],
                                  kwargs["BLOCK_DV"], {k: kwargs.get(k) for k in ("IS_CAUSAL", "GUARD_ROWS")})

    return prune


_dkdv_tuned = lazily_autotuned(_bwd_dkdv_tma_kernel, lambda: _configs("dkdv"), _TUNE_KEY,
                               prune=_pruning("_bwd_dkdv_tma_kernel"), preferred=_PINNED)
_dq_tuned = lazily_autotuned(_bwd_dq_tma_kernel, lambda: _configs("dq"), _TUNE_KEY,
                             prune=_pruning("_bwd_dq_tma_kernel"), preferred=_PINNED)


# --------------------------------------------------------------------------- host side

def tma_backward_unavailable_reason(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor,
                                    key_padding_mask: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                                    dropout_p: float = 0.0) -> Optional[str]:
    """Why the TMA backward cannot run this call (checked arguments, as for ``launch_backward``), or None: the
    TMA forward's conditions, ``grad_out`` a TMA source too, and gradient rows of whole 16-byte units."""
    why = tma_forward_unavailable_reason(q, k, v, key_padding_mask, attn_mask, dropout_p)
    if why is not None:
        return why.replace("TMA forward", "TMA backward")
    if grad_out.dtype != q.dtype:
        return f"grad_out is {grad_out.dtype}, q is {q.dtype}"
    why = tma_ready(grad_out)
    if why is not None:
        return f"grad_out is not a TMA source: {why}"
    if (q.shape[3] * q.element_size()) % 16:
        return f"the gradients' rows ({q.shape[3]} values of q's and k's head dim) are not a multiple of 16 bytes"
    return None


def launch_backward_tma(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor,
                        scale: float, chunk_size: int, is_causal: bool = False,
                        guard_rows: Optional[bool] = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_q, grad_k, grad_v)`` of the TMA backward for a call :func:`tma_backward_unavailable_reason`
    accepts, given the general backward's ``delta`` (``[B, H, M]`` float32, contiguous); ``guard_rows`` as for
    the general kernels (``launch_backward`` of :mod:`.triton_bwd`; None: found out here under the causal rule)."""
    if guard_rows is None:
        guard_rows = bool(is_causal) and not bool(all_finite(q, k))
    B, H, M, D = q.shape
    HKV, N, DV = k.shape[1], k.shape[2], v.shape[3]
    grad_q = torch.empty((B, H, M, D), dtype=q.dtype, device=q.device)
    grad_k = torch.empty((B, HKV, N, D), dtype=k.dtype, device=k.device)
    grad_v = torch.empty((B, HKV, N, DV), dtype=v.dtype, device=v.device)
    ensure_allocator()
    common = (q, k, v, grad_out, lse, delta)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
               *lse.stride())
    sizes = (H, H // HKV, M, N, D, DV, float(scale))
    meta = dict(IS_CAUSAL=bool(is_causal), GUARD_ROWS=bool(guard_rows), UPCAST=interpreting(), BLOCK_D=block_d(D),
                BLOCK_DV=block_d(DV))
    launch(_bwd_dkdv_tma_kernel, _dkdv_tuned, lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), B * HKV),
           (*common, grad_k, grad_v, *strides, *sizes), meta, M, N, chunk_size)
    launch(_bwd_dq_tma_kernel, _dq_tuned, lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), B * H),
           (*common, grad_q, *strides, *sizes), meta, M, N, chunk_size)
    return grad_q, grad_k, grad_v

