"""Triton backward of Tree Cross Attention: ``(dq, dk, dv)`` of ``(out, lse, log_prob, entropy)``.

The gradients are those of autograd through :func:`attn_ext.ops.tree.naive.path_forward` (the
discrete choices are constants). Two launches:

1. ``_policy_grad_kernel``, one program per (batch entry, query block), all heads as in the forward
   (the policy averages them): recomputes π along the path read back from ``selected`` (the group of
   the leaves at ``S − P``, its ancestors by integer division) and stores, per (query, level, child),
   ``dπ_c / H`` with ``dπ_c = g_lp·[c = a]/π_a − g_ent·(log π_c + 1)`` where ``π_c > 0`` and 0 where
   ``π_c = 0`` (as the reference's ``0·log 0`` guard differentiates). ``dπ/H`` is every head's ``dw``.
2. ``_tree_bwd_kernel``, one program per (batch entry · head, query block): per level the head's
   child softmax ``w`` gives ``dlogit = w·(dw − Σ w·dw)``; over ``S`` the attention backward of docs/spec.md §1
   (``P = exp(s − lse)``, ``Δ = Σ_j P_j dP_j``, ``dS = P (dP − Δ + g_lse)``). ``dq`` is owned by the
   program; ``dk``/``dv`` rows are shared by every query that selected the node, so they are summed
   with ``tl.atomic_add`` into fp32 buffers (order-dependent rounding: not bitwise deterministic on GPU).

Tiles of pass 2 are per head: gathered keys ``[BLOCK_M, BLOCK_B or BLOCK_S, BLOCK_D]`` (node ids
differ per query, so again no ``tl.dot``). ``Δ`` needs the whole of ``S`` before any ``dS``: ``S`` is
walked twice in chunks of ``BLOCK_S`` rather than held, so the tiles stay bounded for any group size.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from attn_ext.ops.tree.triton_fwd import _gather_scores
from attn_ext.ops.utils.triton import SUPPORTED_DTYPES, check_device, interpreting

__all__ = ["tree_cross_attention_bwd_triton"]


@triton.jit
def _path_group(SEL, sel_rows, sss, S, group_size, leaf_offset, m_ok):
    """Group index ``[BLOCK_M]`` (int64) of each query's chosen group, from its first leaf id."""
    first_leaf = tl.load(sel_rows + (S - group_size) * sss, mask=m_ok, other=0)
    return tl.where(m_ok, (first_leaf - leaf_offset) // group_size, 0)


@triton.jit
def _policy_grad_kernel(
    Q, K, MASK, SEL, GLP, GENT, DPI,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    smb, smn,
    ssb, ssm, sss,
    H, M, D, height, group_size, num_groups, leaf_offset, S, scale,
    BRANCH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    pid_m = tl.program_id(0)
    off_b = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_b = tl.arange(0, BLOCK_B)
    m_ok = offs_m < M
    h_ok = offs_h < H
    d_ok = offs_d < D
    child_ok = offs_b < BRANCH

    q = tl.load(Q + off_b * sqb + offs_m[:, None, None] * sqm + offs_h[None, :, None] * sqh
                + offs_d[None, None, :] * sqd,
                mask=m_ok[:, None, None] & h_ok[None, :, None] & d_ok[None, None, :], other=0.0).to(tl.float32)
    group = _path_group(SEL, SEL + off_b * ssb + offs_m.to(tl.int64) * ssm, sss, S, group_size, leaf_offset, m_ok)
    g_lp = tl.load(GLP + off_b * M + offs_m, mask=m_ok, other=0.0)
    g_ent = tl.load(GENT + off_b * M + offs_m, mask=m_ok, other=0.0)
    dpi_rows = DPI + ((off_b * M + offs_m) * height)[:, None] * BLOCK_B + offs_b[None, :]

    # Node at depth l on the path: o_l + group // b^(height − l), o_l the first id of level l.
    level_first = tl.zeros([BLOCK_M], tl.int64)
    span = tl.zeros([BLOCK_M], tl.int64) + num_groups
    for level in range(height):
        first = (level_first + group // span) * BRANCH + 1
        level_first = level_first * BRANCH + 1
        span = span // BRANCH
        choice = level_first + group // span - first
        scores, valid = _gather_scores(q, K + off_b * skb, MASK + off_b * smb, smn, first, BRANCH, scale, skh, skn, skd,
                                       offs_h, offs_d, h_ok, d_ok, m_ok, BLOCK_M, BLOCK_H, BLOCK_B)
        head_max = tl.max(scores, axis=2)
        head_has = head_max > float("-inf")
        e = tl.where(valid[:, None, :], tl.exp(scores - tl.where(head_has, head_max, 0.0)[:, :, None]), 0.0)
        w = e / tl.where(head_has, tl.sum(e, axis=2), 1.0)[:, :, None]
        pi = tl.sum(tl.where(h_ok[None, :, None], w, 0.0), axis=1) / H

        chosen = offs_b[None, :] == choice[:, None]
        positive = pi > 0.0
        safe_pi = tl.where(positive, pi, 1.0)
        d_pi = tl.where(chosen & positive, g_lp[:, None] / safe_pi, 0.0)
        d_pi -= tl.where(positive, g_ent[:, None] * (tl.log(safe_pi) + 1.0), 0.0)
        tl.store(dpi_rows + level * BLOCK_B, d_pi / H, mask=m_ok[:, None] & child_ok[None, :])


@triton.jit
def _tree_bwd_kernel(
    Q, K, V, MASK, SEL, LSE, DO, GLSE, DPI, DQ, DK_ACC, DV_ACC,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    smb, smn,
    ssb, ssm, sss,
    slb, slh, slm,
    sob, soh, som, sod,
    sgb, sgh, sgm,
    H, M, D, DV, height, group_size, num_groups, leaf_offset, S, scale,
    BRANCH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_b = tl.arange(0, BLOCK_B)
    offs_s = tl.arange(0, BLOCK_S)
    m_ok = offs_m < M
    d_ok = offs_d < D
    dv_ok = offs_dv < DV

    q = tl.load(Q + off_b * sqb + off_h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    k_base = K + off_b * skb + off_h * skh
    v_base = V + off_b * svb + off_h * svh
    # DK_ACC and DV_ACC are fresh contiguous fp32 [B, H, num_nodes, ·] buffers.
    num_nodes = leaf_offset + group_size * num_groups
    dk_base = DK_ACC + pid_bh.to(tl.int64) * num_nodes * D
    dv_base = DV_ACC + pid_bh.to(tl.int64) * num_nodes * DV
    mask_row = MASK + off_b * smb
    sel_rows = SEL + off_b * ssb + offs_m.to(tl.int64) * ssm
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    group = _path_group(SEL, sel_rows, sss, S, group_size, leaf_offset, m_ok)
    dpi_rows = DPI + ((off_b * M + offs_m) * height)[:, None] * BLOCK_B + offs_b[None, :]
    level_first = tl.zeros([BLOCK_M], tl.int64)
    span = tl.zeros([BLOCK_M], tl.int64) + num_groups
    for level in range(height):
        ids = ((level_first + group // span) * BRANCH + 1)[:, None] + offs_b[None, :]
        level_first = level_first * BRANCH + 1
        span = span // BRANCH
        valid = m_ok[:, None] & (offs_b[None, :] < BRANCH)
        valid = valid & (tl.load(mask_row + ids * smn, mask=valid, other=1) == 0)
        k = tl.load(k_base + ids[:, :, None] * skn + offs_d[None, None, :] * skd,
                    mask=valid[:, :, None] & d_ok[None, None, :], other=0.0).to(tl.float32)
        logits = tl.where(valid, tl.sum(q[:, None, :] * k, axis=2) * scale, float("-inf"))
        row_max = tl.max(logits, axis=1)
        e = tl.where(valid, tl.exp(logits - tl.where(row_max > float("-inf"), row_max, 0.0)[:, None]), 0.0)
        w = e / tl.where(row_max > float("-inf"), tl.sum(e, axis=1), 1.0)[:, None]
        dw = tl.load(dpi_rows + level * BLOCK_B, mask=valid, other=0.0)
        d_logit = w * (dw - tl.sum(w * dw, axis=1)[:, None]) * scale
        dq += tl.sum(d_logit[:, :, None] * k, axis=1)
        tl.atomic_add(dk_base + ids[:, :, None] * D + offs_d[None, None, :], d_logit[:, :, None] * q[:, None, :],
                      mask=valid[:, :, None] & d_ok[None, None, :])

    lse = tl.load(LSE + off_b * slb + off_h * slh + offs_m * slm, mask=m_ok, other=float("-inf"))
    g_lse = tl.load(GLSE + off_b * sgb + off_h * sgh + offs_m * sgm, mask=m_ok, other=0.0)
    d_out = tl.load(DO + off_b * sob + off_h * soh + offs_m[:, None] * som + offs_dv[None, :] * sod,
                    mask=m_ok[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
    # A row without a valid selected node (lse = −inf) has P = 0: no exp(−inf − (−inf)) is formed.
    row_ok = m_ok & (lse > float("-inf"))
    lse = tl.where(row_ok, lse, 0.0)
    delta = tl.zeros([BLOCK_M], tl.float32)
    for sweep in tl.static_range(2):
        for start in range(0, S, BLOCK_S):
            valid = row_ok[:, None] & ((start + offs_s) < S)[None, :]
            ids = tl.load(sel_rows[:, None] + (start + offs_s)[None, :] * sss, mask=valid, other=0)
            valid = valid & (tl.load(mask_row + ids * smn, mask=valid, other=1) == 0)
            k = tl.load(k_base + ids[:, :, None] * skn + offs_d[None, None, :] * skd,
                        mask=valid[:, :, None] & d_ok[None, None, :], other=0.0).to(tl.float32)
            v = tl.load(v_base + ids[:, :, None] * svn + offs_dv[None, None, :] * svd,
                        mask=valid[:, :, None] & dv_ok[None, None, :], other=0.0).to(tl.float32)
            p = tl.where(valid, tl.exp(tl.sum(q[:, None, :] * k, axis=2) * scale - lse[:, None]), 0.0)
            d_p = tl.sum(d_out[:, None, :] * v, axis=2)
            if sweep == 0:
                delta += tl.sum(p * d_p, axis=1)
            else:
                d_s = p * (d_p - delta[:, None] + g_lse[:, None]) * scale
                dq += tl.sum(d_s[:, :, None] * k, axis=1)
                tl.atomic_add(dk_base + ids[:, :, None] * D + offs_d[None, None, :], d_s[:, :, None] * q[:, None, :],
                              mask=valid[:, :, None] & d_ok[None, None, :])
                tl.atomic_add(dv_base + ids[:, :, None] * DV + offs_dv[None, None, :],
                              p[:, :, None] * d_out[:, None, :], mask=valid[:, :, None] & dv_ok[None, None, :])

    tl.store(DQ + ((off_b * H + off_h) * M + offs_m)[:, None] * D + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])


def tree_cross_attention_bwd_triton(grad_out, grad_lse, grad_log_prob, grad_entropy, q, node_k, node_v,
                                    node_padding_mask, selected, lse, branching, height, group_size, scale):
    """Gradients of the fused Tree Cross Attention forward (Triton), as autograd through ``path_forward``.

    Parameters
    ----------
    grad_out : torch.Tensor
        ``[B, H, M, Dv]``, upstream gradient of ``out``.
    grad_lse : torch.Tensor
        ``[B, H, M]``, upstream gradient of ``lse``.
    grad_log_prob, grad_entropy : torch.Tensor
        ``[B, M]``, upstream gradients of ``log_prob`` and ``entropy``.
    q, node_k, node_v, node_padding_mask : torch.Tensor
        The forward's inputs (see :func:`attn_ext.ops.tree.triton_fwd.tree_cross_attention_fwd_triton`).
    selected, lse : torch.Tensor
        The forward's ``selected [B, M, S]`` (the path is read back from its last ``P`` ids) and
        ``lse [B, H, M]``.
    branching, height, group_size : int
        The tree's ``b``, ``k``, ``P``.
    scale : float
        The forward's score scale.

    Returns
    -------
    dq, dk, dv : torch.Tensor
        In the dtypes and shapes of ``q``, ``node_k``, ``node_v`` (contiguous); accumulated in fp32.
        Padding nodes and rows without a valid selected node get exact zeros.

    Raises
    ------
    ValueError, TypeError, RuntimeError
        Shapes that do not match the tree or each other, unsupported dtypes, unusable devices.
    """
    B, H, M, D = q.shape if q.dim() == 4 else (None,) * 4
    if D is None or node_k.dim() != 4 or node_v.dim() != 4:
        raise ValueError(f"attn_ext: q, node_k, node_v must be 4-D; got q {tuple(q.shape)}, node_k "
                         f"{tuple(node_k.shape)}, node_v {tuple(node_v.shape)}")
    if q.dtype not in SUPPORTED_DTYPES or not (q.dtype == node_k.dtype == node_v.dtype == grad_out.dtype):
        raise TypeError(f"attn_ext: q, node_k, node_v, grad_out must share one of float32/float16/bfloat16; got "
                        f"{q.dtype}, {node_k.dtype}, {node_v.dtype}, {grad_out.dtype}")
    DV = node_v.shape[3]
    S = height * (branching - 1) + group_size
    num_groups = branching**height
    leaf_offset = (branching ** (height + 1) - 1) // (branching - 1)
    num_nodes = leaf_offset + group_size * num_groups
    expected = {"node_k": (node_k, (B, H, num_nodes, D)), "node_v": (node_v, (B, H, num_nodes, DV)),
                "node_padding_mask": (node_padding_mask, (B, num_nodes)), "selected": (selected, (B, M, S)),
                "lse": (lse, (B, H, M)), "grad_out": (grad_out, (B, H, M, DV)), "grad_lse": (grad_lse, (B, H, M)),
                "grad_log_prob": (grad_log_prob, (B, M)), "grad_entropy": (grad_entropy, (B, M))}
    for name, (t, shape) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"attn_ext: {name} must be {list(shape)} for q {tuple(q.shape)} and a tree with "
                             f"branching {branching}, height {height}, group size {group_size}; got {list(t.shape)}")
    if node_padding_mask.dtype != torch.bool or selected.dtype != torch.int64:
        raise TypeError(f"attn_ext: node_padding_mask must be bool and selected int64, got {node_padding_mask.dtype}"
                        f" and {selected.dtype}")
    if not math.isfinite(scale):
        raise ValueError(f"attn_ext: scale must be finite, got {scale!r}")
    check_device(_tree_bwd_kernel, q, node_k, node_v, node_padding_mask, selected, lse, grad_out, grad_lse,
                  grad_log_prob, grad_entropy)
    device = q.device
    dq = torch.empty((B, H, M, D), dtype=q.dtype, device=device)
    dk = torch.zeros((B, H, num_nodes, D), dtype=torch.float32, device=device)
    dv = torch.zeros((B, H, num_nodes, DV), dtype=torch.float32, device=device)
    if B * M * H == 0:
        return dq, dk.to(node_k.dtype), dv.to(node_v.dtype)

    mask = node_padding_mask.contiguous().view(torch.uint8)
    g_lp = grad_log_prob.to(torch.float32).contiguous()
    g_ent = grad_entropy.to(torch.float32).contiguous()
    g_lse = grad_lse.to(torch.float32)
    lse = lse.to(torch.float32)
    block_b = triton.next_power_of_2(branching)
    block_h, block_d, block_dv = (triton.next_power_of_2(max(x, 1)) for x in (H, D, DV))  # Dv = 0: no column
    block_m = min(16, triton.next_power_of_2(M))
    if not interpreting():
        block_m = max(1, min(block_m, 8192 // (block_h * block_d), 8192 // max(block_b, 16) // max(block_d, block_dv)))
        block_m = 1 << (block_m.bit_length() - 1)
    tree_args = (height, group_size, num_groups, leaf_offset, S, float(scale))
    d_pi = torch.empty((B, M, height, block_b), dtype=torch.float32, device=device)
    if height > 0:
        _policy_grad_kernel[(triton.cdiv(M, block_m), B)](
            q, node_k, mask, selected, g_lp, g_ent, d_pi,
            *q.stride(), *node_k.stride(), *mask.stride(), *selected.stride(), H, M, D, *tree_args,
            BRANCH=branching, BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_B=block_b)
    _tree_bwd_kernel[(triton.cdiv(M, block_m), B * H)](
        q, node_k, node_v, mask, selected, lse, grad_out, g_lse, d_pi, dq, dk, dv,
        *q.stride(), *node_k.stride(), *node_v.stride(), *mask.stride(), *selected.stride(), *lse.stride(),
        *grad_out.stride(), *g_lse.stride(), H, M, D, DV, *tree_args,
        BRANCH=branching, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_B=block_b,
        BLOCK_S=min(triton.next_power_of_2(S), 16))
    return dq, dk.to(node_k.dtype), dv.to(node_v.dtype)
