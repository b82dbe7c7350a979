"""Triton backward of translation-equivariant attention (``te_attention_bwd``, csrc/op_list.h), the C++ kernel's
algorithm (csrc/cpu/te_attention_bwd.cpp) on a GPU.

One program per (block of ``BLOCK_N`` keys, batch entry): it owns those keys' dK, dV and dxk (held as tiles across
its loop and stored once) and walks every block of queries. Per tile it recomputes the logits (:mod:`.triton_mlp`),
``P = exp(logit − lse)`` and ``dS = P ∘ (dO·Vᵀ − Δ)`` per head (``Δ = rowsum(dO ∘ out) − dlse``, computed before the
launch), then pulls ``dS`` back through ρ a chunk of hidden units at a time into the features' gradients (every
head's dot product, each input difference) and ρ's weight gradients. dQ and dxq are summed across programs with
``tl.atomic_add`` into fp32 buffers (their order, hence their last bits, may vary from run to run); ρ's weight
gradients go to per-program rows (read, add, write: no other program touches them) that the host sums, so they
are deterministic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_ext.ops.te_attention.triton_fwd import NUM_WARPS, launch_arguments, tile_sizes
from attn_ext.ops.te_attention.triton_mlp import (activate, activation_derivative, chunk_preactivations, head_slice,
                                                  tile_features, tile_logits)
from attn_ext.ops.utils.triton import check_device, next_pow2
from attn_ext.ops.utils.triton_jit import load_tile, valid_rows

__all__ = ["te_attention_bwd_triton"]


@triton.jit
def _add_to(ptr, values, mask):
    """``*ptr += values`` where ``mask``, for rows only this program writes."""
    tl.store(ptr, tl.load(ptr, mask=mask, other=0.0) + values, mask=mask)


@triton.jit
def _te_bwd_kernel(Q, K, V, XQ, XK, W1, B1, W2, B2, MASK, DO, DELTA, LSE,
                   DQ, DK, DV, DXQ, DXK, DW1P, DB1P, DW2P, DB2P,
                   sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sxqb, sxqm, sxqd, sxkb, sxkn, sxkd,
                   smb, smn, sdob, sdoh, sdom, sdod,
                   M, N, D, DV_, HIDDEN, scale,
                   H: tl.constexpr, DX: tl.constexpr, ACT: tl.constexpr, HAS_MASK: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_DX: tl.constexpr,
                   BLOCK_HIDDEN: tl.constexpr, HIDDEN_CHUNK: tl.constexpr):
    pid_n, b = tl.program_id(0), tl.program_id(1)
    program = b * tl.num_programs(0) + pid_n
    F: tl.constexpr = H + DX
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d, offs_dv, offs_h = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_H)
    offs_x, offs_f = tl.arange(0, BLOCK_DX), tl.arange(0, BLOCK_F)
    d_ok, dv_ok = offs_d < D, offs_dv < DV_
    n_ok = valid_rows(MASK, b * smb, smn, offs_n, N, HAS_MASK)
    q_row, k_row, v_row, xq_row, xk_row = b * sqb, b * skb, b * svb, b * sxqb, b * sxkb
    dk = tl.zeros([BLOCK_N, BLOCK_H, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_H, BLOCK_DV], tl.float32)
    dxk = tl.zeros([BLOCK_N, BLOCK_DX], tl.float32)
    for m0 in range(0, M, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        features = tile_features(Q, K, XQ, XK, q_row, k_row, xq_row, xk_row, sqh, sqm, sqd, skh, skn, skd, sxqm, sxqd,
                                 sxkn, sxkd, offs_m, offs_n, offs_d, offs_f, m_ok, n_ok, d_ok, scale, H, DX, BLOCK_M,
                                 BLOCK_N, BLOCK_F)
        logits = tile_logits(features, W1, B1, W2, B2, offs_f, offs_h, HIDDEN, H, F, ACT, HIDDEN_CHUNK, BLOCK_HIDDEN,
                             BLOCK_M, BLOCK_N, BLOCK_H)
        ds = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_H], tl.float32)
        for h in tl.static_range(H):
            stats = b * H * M + h * M + offs_m            # lse and Δ are contiguous [B, H, M]
            lse = tl.load(LSE + stats, mask=m_ok, other=float("-inf"))
            delta = tl.load(DELTA + stats, mask=m_ok, other=0.0)
            pair_ok = m_ok[:, None] & n_ok[None, :] & (lse != float("-inf"))[:, None]
            p = tl.where(pair_ok, tl.exp(head_slice(logits, offs_h, h) - tl.where(pair_ok, lse[:, None], 0.0)), 0.0)
            d_out = load_tile(DO + b * sdob + h * sdoh, offs_m, offs_dv, sdom, sdod, m_ok, dv_ok, True)
            v = load_tile(V + v_row + h * svh, offs_n, offs_dv, svn, svd, n_ok, dv_ok, True)
            d_p = tl.dot(d_out, tl.trans(v), input_precision="ieee")
            # P = 0 (padded keys, rows without keys, pad pairs) adds nothing, also where dP − Δ is not finite.
            d_s = tl.where(p == 0.0, 0.0, p * (d_p - delta[:, None]))
            ds += tl.where(offs_h[None, None, :] == h, d_s[:, :, None], 0.0)
            dv += tl.where(offs_h[None, :, None] == h, tl.dot(tl.trans(p), d_out, input_precision="ieee")[:, None, :],
                           0.0)
            tl.store(DB2P + program * H + h, tl.load(DB2P + program * H + h) + tl.sum(tl.sum(d_s, 1), 0))
        d_feat = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_F], tl.float32)
        for c0 in range(0, BLOCK_HIDDEN, HIDDEN_CHUNK):
            offs_c = c0 + tl.arange(0, HIDDEN_CHUNK)
            c_ok = offs_c < HIDDEN
            pre = chunk_preactivations(features, W1, B1, offs_f, c0, HIDDEN, F, HIDDEN_CHUNK)
            hid = activate(pre, ACT)
            d_hid = tl.zeros([BLOCK_M, BLOCK_N, HIDDEN_CHUNK], tl.float32)
            for h in tl.static_range(H):
                d_s = head_slice(ds, offs_h, h)
                w2 = tl.load(W2 + h * HIDDEN + offs_c, mask=c_ok, other=0.0).to(tl.float32)
                d_hid += d_s[:, :, None] * w2[None, None, :]
                _add_to(DW2P + (program * H + h) * HIDDEN + offs_c, tl.sum(tl.sum(hid * d_s[:, :, None], 0), 0), c_ok)
            d_pre = d_hid * activation_derivative(pre, ACT)
            _add_to(DB1P + program * HIDDEN + offs_c, tl.sum(tl.sum(d_pre, 0), 0), c_ok)
            for f in tl.static_range(F):
                x = head_slice(features, offs_f, f)
                _add_to(DW1P + (program * HIDDEN + offs_c) * F + f, tl.sum(tl.sum(d_pre * x[:, :, None], 0), 0), c_ok)
                w1 = tl.load(W1 + offs_c * F + f, mask=c_ok, other=0.0).to(tl.float32)
                d_feat += tl.where(offs_f[None, None, :] == f, tl.sum(d_pre * w1[None, None, :], 2)[:, :, None], 0.0)
        for h in tl.static_range(H):  # the dot products' gradients, times the scale, to q and k
            g = head_slice(d_feat, offs_f, h) * scale
            k = load_tile(K + k_row + h * skh, offs_n, offs_d, skn, skd, n_ok, d_ok, True)
            q = load_tile(Q + q_row + h * sqh, offs_m, offs_d, sqm, sqd, m_ok, d_ok, True)
            tl.atomic_add(DQ + ((b * H + h) * M + offs_m[:, None]) * D + offs_d[None, :],
                          tl.dot(g, k, input_precision="ieee"), mask=m_ok[:, None] & d_ok[None, :])
            dk += tl.where(offs_h[None, :, None] == h, tl.dot(tl.trans(g), q, input_precision="ieee")[:, None, :], 0.0)
        for d in tl.static_range(DX):  # the differences' gradients: + to the query, − to the key
            g = head_slice(d_feat, offs_f, H + d)
            tl.atomic_add(DXQ + (b * M + offs_m) * DX + d, tl.sum(g, 1), mask=m_ok)
            dxk -= tl.where(offs_x[None, :] == d, tl.sum(g, 0)[:, None], 0.0)
    rows = offs_n < N  # a padded key's rows get 0, whatever reached them (its dV from a NaN dO)
    for h in tl.static_range(H):
        here = offs_h[None, :, None] == h
        tl.store(DK + ((b * H + h) * N + offs_n[:, None]) * D + offs_d[None, :],
                 tl.where(n_ok[:, None], tl.sum(tl.where(here, dk, 0.0), 1), 0.0), mask=rows[:, None] & d_ok[None, :])
        tl.store(DV + ((b * H + h) * N + offs_n[:, None]) * DV_ + offs_dv[None, :],
                 tl.where(n_ok[:, None], tl.sum(tl.where(here, dv, 0.0), 1), 0.0), mask=rows[:, None] & dv_ok[None, :])
    tl.store(DXK + (b * N + offs_n[:, None]) * DX + offs_x[None, :], tl.where(n_ok[:, None], dxk, 0.0),
             mask=rows[:, None] & (offs_x[None, :] < DX))


def te_attention_bwd_triton(grad_out, grad_lse, q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask, out, lse, scale,
                            activation, chunk_size):
    """The nine gradients of ``te_attention_bwd`` (csrc/op_list.h), each in its input's dtype."""
    check_device(_te_bwd_kernel, q, k, v, xq, xk, w1, b1, w2, b2, grad_out, out, lse)
    weights, mask, strides, sizes, (B, H, M, N, D, DV, hidden) = launch_arguments(q, k, v, xq, xk, w1, b1, w2, b2,
                                                                                   key_padding_mask)
    f32 = dict(dtype=torch.float32, device=q.device)
    delta = ((grad_out.float() * out.float()).sum(-1) - grad_lse.float()).contiguous()
    lse = lse.float().contiguous()
    dq, dxq = torch.zeros((B, H, M, D), **f32), torch.zeros((B, M, xq.shape[2]), **f32)
    dk, dv, dxk = torch.zeros((B, H, N, D), **f32), torch.zeros((B, H, N, DV), **f32), torch.zeros((B, N, xk.shape[2]),
                                                                                                 **f32)
    block_m, block_n = tile_sizes(M, N)
    programs = triton.cdiv(N, block_n) * B
    F = H + xq.shape[2]
    partial = [torch.zeros(shape, **f32) for shape in ((programs, hidden, F), (programs, hidden), (programs, H, hidden),
                                                       (programs, H))]
    if B * H * M * N > 0:
        do = grad_out if DV > 0 else grad_out.new_zeros((B, H, M, 1))
        values = v if DV > 0 else v.new_zeros((B, H, N, 1))
        dv_buffer = dv if DV > 0 else torch.zeros((B, H, N, 1), **f32)
        strides = (*strides[:8], *values.stride(), *strides[12:])
        sizes = dict(sizes, BLOCK_DV=max(sizes["BLOCK_DV"], 16))
        _te_bwd_kernel[(triton.cdiv(N, block_n), B)](
            q, k, values, xq, xk, *weights, mask, do, delta, lse, dq, dk, dv_buffer, dxq, dxk, *partial, *strides,
            *do.stride(), M, N, D, max(DV, 1), hidden, float(scale), ACT=int(activation), BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_DX=next_pow2(xq.shape[2]), num_warps=NUM_WARPS, **sizes)
    dw1, db1, dw2, db2 = (p.sum(0) for p in partial)
    grads = (dq, dk, dv, dxq, dxk, dw1, db1, dw2, db2)
    return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v, xq, xk, w1, b1, w2, b2)))
