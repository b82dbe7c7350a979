"""Triton forward of translation-equivariant attention (``te_attention_fwd``, csrc/op_list.h), the C++ kernel's
algorithm (csrc/cpu/te_attention.cpp) on a GPU.

One program per (block of ``BLOCK_M`` queries, batch entry). For each block of ``BLOCK_N`` keys it computes every
head's logits ``[BLOCK_M, BLOCK_N, BLOCK_H]`` with ρ run a chunk of hidden units at a time (:mod:`.triton_mlp`), then
one online-softmax step per head and the value sum by ``tl.dot``. The per-head running state (max, sum,
``[BLOCK_M, BLOCK_H, BLOCK_DV]`` weighted values) is a tile with the heads as a dimension. Padded keys are never
loaded; a query without a key gets ``(0, −inf)``, a NaN logit a NaN row (:func:`attention_rows`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_ext.ops.te_attention.triton_mlp import head_slice, tile_features, tile_logits
from attn_ext.ops.utils.triton import block_dim, check_device, mask_arg, next_pow2
from attn_ext.ops.utils.triton_jit import attention_rows, valid_rows

__all__ = ["HIDDEN_CHUNK", "NUM_WARPS", "te_attention_fwd_triton", "tile_sizes"]


@triton.jit
def _te_fwd_kernel(Q, K, V, XQ, XK, W1, B1, W2, B2, MASK, OUT, LSE,
                   sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sxqb, sxqm, sxqd, sxkb, sxkn, sxkd,
                   smb, smn, sob, soh, som, sod, slb, slh, slm,
                   M, N, D, DV, HIDDEN, scale,
                   H: tl.constexpr, DX: tl.constexpr, ACT: tl.constexpr, HAS_MASK: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_HIDDEN: tl.constexpr,
                   HIDDEN_CHUNK: tl.constexpr):
    pid_m, b = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d, offs_dv, offs_h = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_H)
    offs_f = tl.arange(0, BLOCK_F)
    m_ok, d_ok, dv_ok = offs_m < M, offs_d < D, offs_dv < DV
    q_row, k_row, v_row = b * sqb, b * skb, b * svb
    xq_row, xk_row = b * sxqb, b * sxkb
    run_max = tl.full([BLOCK_M, BLOCK_H], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_H, BLOCK_DV], tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = valid_rows(MASK, b * smb, smn, offs_n, N, HAS_MASK)
        features = tile_features(Q, K, XQ, XK, q_row, k_row, xq_row, xk_row, sqh, sqm, sqd, skh, skn, skd, sxqm, sxqd,
                                 sxkn, sxkd, offs_m, offs_n, offs_d, offs_f, m_ok, n_ok, d_ok, scale, H, DX, BLOCK_M,
                                 BLOCK_N, BLOCK_F)
        logits = tile_logits(features, W1, B1, W2, B2, offs_f, offs_h, HIDDEN, H, H + DX, ACT, HIDDEN_CHUNK,
                             BLOCK_HIDDEN, BLOCK_M, BLOCK_N, BLOCK_H)
        for h in tl.static_range(H):
            here = offs_h[None, :] == h
            s = tl.where(n_ok[None, :], head_slice(logits, offs_h, h), float("-inf"))
            old_max = tl.max(tl.where(here, run_max, float("-inf")), 1)
            new_max = tl.maximum(old_max, tl.max(s, 1))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)   # no key yet: exp(−inf − 0) = 0
            factor = tl.exp(old_max - shift)
            p = tl.exp(s - shift[:, None])
            v = tl.load(V + v_row + h * svh + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                        mask=n_ok[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
            pv = tl.dot(p, v, input_precision="ieee")
            acc = tl.where(here[:, :, None], acc * factor[:, None, None] + pv[:, None, :], acc)
            run_sum = tl.where(here, (run_sum * factor[:, None] + tl.sum(p, 1)[:, None]), run_sum)
            run_max = tl.where(here, new_max[:, None], run_max)
    for h in tl.static_range(H):
        here = offs_h[None, :] == h
        out, lse = attention_rows(tl.sum(tl.where(here[:, :, None], acc, 0.0), 1),
                                  tl.sum(tl.where(here, run_sum, 0.0), 1), tl.max(tl.where(here, run_max, float("-inf")), 1))
        tl.store(OUT + b * sob + h * soh + offs_m[:, None] * som + offs_dv[None, :] * sod,
                 out.to(OUT.dtype.element_ty), mask=m_ok[:, None] & dv_ok[None, :])
        tl.store(LSE + b * slb + h * slh + offs_m * slm, lse, mask=m_ok)


#: Hidden units per chunk of ρ and warps per program: with 16 x 16 pairs, 8 units and 8 warps the sm_80 and sm_90
#: compiles keep every tile in registers (16 units or 4 warps spilled; test_te_attention_triton_machine_code.py).
HIDDEN_CHUNK = 8
NUM_WARPS = 8


def tile_sizes(M: int, N: int) -> tuple:
    """``(BLOCK_M, BLOCK_N)``: 16 x 16 pairs (``tl.dot``'s smallest tile). A chunk of ρ's pre-activations is a
    ``[BLOCK_M, BLOCK_N, 16]`` tile: at 32 x 32 it alone is 128 fp32 per thread of 4 warps, and the sm_90 compile
    spilled 9 KB (forward) and 7 KB (backward) of it to local memory."""
    return 16, 16


def launch_arguments(q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask):
    """The strides, sizes and tile widths both kernels take (the MLP's weights contiguous)."""
    B, H, M, D = q.shape
    N, DV, DX, hidden = k.shape[2], v.shape[3], xq.shape[2], w1.shape[0]
    mask, smb, smn, has_mask = mask_arg(key_padding_mask, q)
    weights = [t.contiguous() for t in (w1, b1, w2, b2)]
    sizes = dict(H=H, DX=DX, HAS_MASK=has_mask, BLOCK_D=block_dim(D), BLOCK_DV=block_dim(DV), BLOCK_H=next_pow2(H),
                 BLOCK_F=next_pow2(H + DX), BLOCK_HIDDEN=max(16, next_pow2(hidden)), HIDDEN_CHUNK=HIDDEN_CHUNK)
    strides = (*q.stride(), *k.stride(), *v.stride(), *xq.stride(), *xk.stride(), smb, smn)
    return weights, mask, strides, sizes, (B, H, M, N, D, DV, hidden)


def te_attention_fwd_triton(q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask, scale, activation, chunk_size):
    """``(out [B, H, M, Dv] in q's dtype, lse [B, H, M] fp32)`` of ``te_attention_fwd`` (csrc/op_list.h);
    ``chunk_size`` is the C++ kernel's tile and is not used here (the tiles are :func:`tile_sizes`')."""
    check_device(_te_fwd_kernel, q, k, v, xq, xk, w1, b1, w2, b2)
    weights, mask, strides, sizes, (B, H, M, N, D, DV, hidden) = launch_arguments(q, k, v, xq, xk, w1, b1, w2, b2,
                                                                                   key_padding_mask)
    out = torch.empty((B, H, M, DV), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, M), dtype=torch.float32, device=q.device)
    if B * M * H == 0:
        return out, lse
    if DV == 0:  # no value column: the lse alone, from a kernel run with one zero column
        padded = v.new_zeros((B, H, N, 1))
        return out, te_attention_fwd_triton(q, k, padded, xq, xk, w1, b1, w2, b2, key_padding_mask, scale,
                                            activation, chunk_size)[1]
    block_m, block_n = tile_sizes(M, N)
    _te_fwd_kernel[(triton.cdiv(M, block_m), B)](
        q, k, v, xq, xk, *weights, mask, out, lse, *strides, *out.stride(), *lse.stride(), M, N, D, DV, hidden,
        float(scale), ACT=int(activation), BLOCK_M=block_m, BLOCK_N=block_n, num_warps=NUM_WARPS, **sizes)
    return out, lse
