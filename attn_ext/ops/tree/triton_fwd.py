"""Triton forward of Tree Cross Attention (docs/spec.md §3 "Retrieve" + "Attend"), fused per query block.

Same semantics as the C++ kernel (csrc/cpu/tree_cross_attention.cpp, csrc/include/attn_ext/tree_descent.h):
per level the policy is the head mean of the per-head softmax over the valid children, the choice is
the argmax (ties to the first child) or the inverse-CDF draw ``#{c : cdf_c <= u·cdf_last}`` capped at
``b − 1``, the rejected children and then the ``P`` leaves of the chosen group are folded into one
online-softmax row per head. The node-id layout is attn_ext/ops/tree/build.py's (heap layout).

Design
------
One program per (batch entry, block of ``BLOCK_M`` queries). The heads are a tile dimension, not a
loop: the policy needs every head's softmax over the children before the level's choice, and the
per-head online-softmax state must live across all levels; a tile ``[BLOCK_M, BLOCK_H, ·]`` holds
both without re-reading the children's keys once per head. Working tiles:

* ``q``: ``[BLOCK_M, BLOCK_H, BLOCK_D]``, loaded once (fp32);
* scores of a level: ``[BLOCK_M, BLOCK_H, BLOCK_B]`` (``BLOCK_B = next_pow2(b)``, columns ``>= b`` masked),
  of a leaf chunk: ``[BLOCK_M, BLOCK_H, BLOCK_P]``;
* accumulators: ``acc [BLOCK_M, BLOCK_H, BLOCK_DV]``, running max / sum ``[BLOCK_M, BLOCK_H]``.

Every query of a block reads *its own* nodes (a gather by node id), so there is no shared key tile and
no ``tl.dot``: a column (one child / leaf per query) is loaded as ``[BLOCK_M, BLOCK_H, BLOCK_D]`` and
reduced over ``D``. The columns are unrolled (``b`` and ``BLOCK_P`` are constexpr and small).

Non-finite inputs (docs/tree.md, "NaN and infinity"), as the C++ kernel: a level whose policy would be
NaN in torch.softmax (a valid child's score NaN or +inf, or a head whose valid children all score
−inf) follows the first valid child and makes the query's out, lse, log_prob and entropy NaN; a head
whose running sum ends NaN, or 0 after a valid node was read, gets NaN out and lse. They are tested
explicitly rather than left to ``tl.max``, whose NaN handling Triton leaves unspecified.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from attn_ext.ops.utils.triton import SUPPORTED_DTYPES, check_device, interpreting, lazily_autotuned

__all__ = ["tree_cross_attention_fwd_triton"]


@triton.jit
def _column_scores(q, k_base, mask_row, smn, first, col, count, scale, skh, skn, skd, offs_h, offs_d,
                   h_ok, d_ok, m_ok):
    """Scores ``[BLOCK_M, BLOCK_H]`` of node ``first + col`` of each query and its validity ``[BLOCK_M]``."""
    ids = first + col
    # A tensor comparison, not `col < count`: the interpreter turns `tensor & scalar bool` into int32,
    # which tl.load then rejects as a mask.
    valid = m_ok & ((tl.zeros_like(first) + col) < count)
    valid = valid & (tl.load(mask_row + ids * smn, mask=valid, other=1) == 0)
    # Padding nodes are not loaded: their (possibly non-finite) keys must not leak through 0·inf.
    k = tl.load(k_base + ids[:, None, None] * skn + offs_h[None, :, None] * skh + offs_d[None, None, :] * skd,
                mask=valid[:, None, None] & h_ok[None, :, None] & d_ok[None, None, :], other=0.0).to(tl.float32)
    return tl.sum(q * k, axis=2) * scale, valid


@triton.jit
def _gather_scores(q, k_base, mask_row, smn, first, count, scale, skh, skn, skd, offs_h, offs_d, h_ok, d_ok, m_ok,
                   BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, WIDTH: tl.constexpr):
    """Scores ``[BLOCK_M, BLOCK_H, WIDTH]`` of nodes ``first + [0, WIDTH)`` (−inf where invalid) and validity."""
    offs_w = tl.arange(0, WIDTH)
    scores = tl.full([BLOCK_M, BLOCK_H, WIDTH], float("-inf"), tl.float32)
    valid = tl.zeros([BLOCK_M, WIDTH], tl.int1)
    for col in tl.static_range(WIDTH):
        s, ok = _column_scores(q, k_base, mask_row, smn, first, col, count, scale, skh, skn, skd, offs_h, offs_d,
                               h_ok, d_ok, m_ok)
        here = offs_w[None, :] == col
        scores = tl.where(here[:, None, :] & ok[:, None, None], s[:, :, None], scores)
        valid = valid | (here & ok[:, None])
    return scores, valid


@triton.jit
def _fold(scores, take, first, v_base, svh, svn, svd, offs_h, offs_dv, h_ok, dv_ok, row_max, row_sum, acc,
          WIDTH: tl.constexpr):
    """Folds the columns ``take [BLOCK_M, WIDTH]`` (nodes ``first + col``) into the per-head online softmax."""
    offs_w = tl.arange(0, WIDTH)
    scores = tl.where(take[:, None, :], scores, float("-inf"))
    # The max skips NaN explicitly (tl.max leaves it unspecified); a NaN score still reaches row_sum via p.
    new_max = tl.maximum(row_max, tl.max(tl.where(scores == scores, scores, float("-inf")), axis=2))
    # A head that has seen no valid node keeps max −inf: shift by 0 so that no (−inf) − (−inf) appears.
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    alpha = tl.exp(row_max - shift)
    p = tl.exp(scores - shift[:, :, None])
    row_sum = row_sum * alpha + tl.sum(p, axis=2)
    acc = acc * alpha[:, :, None]
    for col in tl.static_range(WIDTH):
        here = offs_w[None, :] == col
        col_take = tl.sum((here & take).to(tl.int32), axis=1) > 0
        p_col = tl.sum(tl.where(here[:, None, :], p, 0.0), axis=2)
        ids = first + col
        v = tl.load(v_base + ids[:, None, None] * svn + offs_h[None, :, None] * svh + offs_dv[None, None, :] * svd,
                    mask=col_take[:, None, None] & h_ok[None, :, None] & dv_ok[None, None, :],
                    other=0.0).to(tl.float32)
        acc += p_col[:, :, None] * v
    return new_max, row_sum, acc


@triton.jit
def _tree_fwd_kernel(
    Q, K, V, MASK, U, OUT, LSE, SEL, LOG_PROB, ENTROPY,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    smb, smn,
    s_ub, s_um, s_ut,
    sob, soh, som, sod,
    slb, slh, slm,
    ssb, ssm, sss,
    H, M, D, DV, height, group_size, group_offset, leaf_offset, scale,
    BRANCH: tl.constexpr, SAMPLE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid_m = tl.program_id(0)
    off_b = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_b = tl.arange(0, BLOCK_B)
    offs_p = tl.arange(0, BLOCK_P)
    m_ok = offs_m < M
    h_ok = offs_h < H
    d_ok = offs_d < D
    dv_ok = offs_dv < DV
    child_ok = offs_b < BRANCH

    q = tl.load(Q + off_b * sqb + offs_m[:, None, None] * sqm + offs_h[None, :, None] * sqh
                + offs_d[None, None, :] * sqd,
                mask=m_ok[:, None, None] & h_ok[None, :, None] & d_ok[None, None, :], other=0.0).to(tl.float32)
    k_base = K + off_b * skb
    v_base = V + off_b * svb
    mask_row = MASK + off_b * smb
    sel_rows = SEL + off_b * ssb + offs_m.to(tl.int64) * ssm

    row_max = tl.full([BLOCK_M, BLOCK_H], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_H, BLOCK_DV], tl.float32)
    log_prob = tl.zeros([BLOCK_M], tl.float32)
    entropy = tl.zeros([BLOCK_M], tl.float32)
    node = tl.zeros([BLOCK_M], tl.int64)  # every descent starts at the root
    descent_nan = tl.zeros([BLOCK_M], tl.int1)  # some level's policy was NaN
    seen_valid = tl.zeros([BLOCK_M], tl.int1)  # some valid node was folded in

    for level in range(height):
        first = node * BRANCH + 1
        scores, valid = _gather_scores(q, k_base, mask_row, smn, first, BRANCH, scale, skh, skn, skd,
                                       offs_h, offs_d, h_ok, d_ok, m_ok, BLOCK_M, BLOCK_H, BLOCK_B)
        head_max = tl.max(tl.where(scores == scores, scores, float("-inf")), axis=2)
        head_has = head_max > float("-inf")
        e = tl.where(valid[:, None, :], tl.exp(scores - tl.where(head_has, head_max, 0.0)[:, :, None]), 0.0)
        w = e / tl.where(head_has, tl.sum(e, axis=2), 1.0)[:, :, None]
        pi = tl.sum(tl.where(h_ok[None, :, None], w, 0.0), axis=1) / H  # [BLOCK_M, BLOCK_B]
        # NaN or +inf (not < inf) at a valid child, or a head with valid children all at −inf.
        bad = valid[:, None, :] & h_ok[None, :, None] & ~(scores < float("inf"))
        any_child = tl.sum(valid.to(tl.int32), axis=1) > 0
        all_ninf = any_child[:, None] & h_ok[None, :] & (tl.sum(tl.where(valid[:, None, :] & (scores > float("-inf")),
                                                                         1, 0), axis=2) == 0)
        step_nan = (tl.sum(tl.sum(bad.to(tl.int32), axis=2), axis=1) + tl.sum(all_ninf.to(tl.int32), axis=1)) > 0
        descent_nan = descent_nan | step_nan
        pi = tl.where(step_nan[:, None], 0.0, pi)  # no NaN into the choice (the interpreter's argmax rejects it)

        if SAMPLE:
            u = tl.load(U + off_b * s_ub + offs_m * s_um + level * s_ut, mask=m_ok, other=0.0)
            # Prefix sums in fp64 rounded to fp32 per prefix: what torch.cumsum and the C++ kernel do,
            # so the same uniforms draw the same children.
            cdf = tl.cumsum(tl.where(child_ok[None, :], pi, 0.0).to(tl.float64), axis=1).to(tl.float32)
            threshold = u * tl.max(cdf, axis=1)
            below = (cdf <= threshold[:, None]) & child_ok[None, :]
            choice = tl.minimum(tl.sum(below.to(tl.int32), axis=1), BRANCH - 1)
        else:
            choice = tl.argmax(tl.where(child_ok[None, :], pi, -1.0), axis=1, tie_break_left=True).to(tl.int32)
        first_valid = tl.argmax(valid.to(tl.int32), axis=1, tie_break_left=True).to(tl.int32)
        choice = tl.where(step_nan, first_valid, choice)

        chosen = offs_b[None, :] == choice[:, None]
        pi_choice = tl.sum(tl.where(chosen, pi, 0.0), axis=1)
        log_prob += tl.where(pi_choice > 0.0, tl.log(tl.where(pi_choice > 0.0, pi_choice, 1.0)), float("-inf"))
        positive = pi > 0.0
        entropy -= tl.sum(tl.where(positive, pi * tl.log(tl.where(positive, pi, 1.0)), 0.0), axis=1)

        rejected = child_ok[None, :] & ~chosen
        slot = level * (BRANCH - 1) + offs_b[None, :] - (offs_b[None, :] > choice[:, None]).to(tl.int32)
        tl.store(sel_rows[:, None] + slot * sss, first[:, None] + offs_b[None, :],
                 mask=rejected & m_ok[:, None])
        row_max, row_sum, acc = _fold(scores, rejected & valid, first, v_base, svh, svn, svd, offs_h, offs_dv,
                                      h_ok, dv_ok, row_max, row_sum, acc, BLOCK_B)
        seen_valid = seen_valid | (tl.sum((rejected & valid).to(tl.int32), axis=1) > 0)
        node = first + choice

    leaf0 = leaf_offset + (node - group_offset) * group_size
    leaf_slot0 = height * (BRANCH - 1)
    for start in range(0, group_size, BLOCK_P):
        first = leaf0 + start
        scores, valid = _gather_scores(q, k_base, mask_row, smn, first, group_size - start, scale, skh, skn, skd,
                                       offs_h, offs_d, h_ok, d_ok, m_ok, BLOCK_M, BLOCK_H, BLOCK_P)
        in_group = (start + offs_p) < group_size
        tl.store(sel_rows[:, None] + (leaf_slot0 + start + offs_p[None, :]) * sss, first[:, None] + offs_p[None, :],
                 mask=in_group[None, :] & m_ok[:, None])
        row_max, row_sum, acc = _fold(scores, valid, first, v_base, svh, svn, svd, offs_h, offs_dv, h_ok, dv_ok,
                                      row_max, row_sum, acc, BLOCK_P)
        seen_valid = seen_valid | (tl.sum(valid.to(tl.int32), axis=1) > 0)

    has_node = row_sum > 0.0
    safe_sum = tl.where(has_node, row_sum, 1.0)
    out = acc / safe_sum[:, :, None]
    lse = tl.where(has_node, row_max + tl.log(safe_sum), float("-inf"))
    # A row that read a valid node has sum >= 1 unless a score was NaN or +inf (sum NaN) or all were −inf.
    row_nan = descent_nan[:, None] | (seen_valid[:, None] & ~has_node)
    out = tl.where(row_nan[:, :, None], float("nan"), out)
    lse = tl.where(row_nan, float("nan"), lse)
    log_prob = tl.where(descent_nan, float("nan"), log_prob)
    entropy = tl.where(descent_nan, float("nan"), entropy)
    tl.store(OUT + off_b * sob + offs_m[:, None, None] * som + offs_h[None, :, None] * soh
             + offs_dv[None, None, :] * sod, out.to(OUT.dtype.element_ty),
             mask=m_ok[:, None, None] & h_ok[None, :, None] & dv_ok[None, None, :])
    tl.store(LSE + off_b * slb + offs_m[:, None] * slm + offs_h[None, :] * slh, lse,
             mask=m_ok[:, None] & h_ok[None, :])
    tl.store(LOG_PROB + off_b * M + offs_m, log_prob, mask=m_ok)
    tl.store(ENTROPY + off_b * M + offs_m, entropy, mask=m_ok)


# --------------------------------------------------------------------------- launch configuration

# Elements of the largest tile (BLOCK_M·BLOCK_H·max(BLOCK_D, BLOCK_DV)) per thread on a GPU. The fp32 query,
# the accumulator and each gathered key/value column hold one such tile in registers. Compiled for sm_80
# (bench/gpu/triton_aot.py), the kernel keeps them in registers up to 16 elements per thread and spills
# from 32 on, whatever the head dim and dtype: at the former budget of 8192 elements per program (64 to
# 128 per thread) every config but the smallest spilled 0.1 to 10 KB per thread, and took 20 to 95 s to
# compile (autotuning compiles them all on the first call of each shape).
_TILE_PER_THREAD = 16
_WARPS = (2, 4)


def _block_m_cap(m: int, block_h: int, block_width: int, num_warps: int) -> int:
    """The largest power-of-two query tile within ``_TILE_PER_THREAD`` (at least 1, at most 64)."""
    cap = max(1, _TILE_PER_THREAD * 32 * num_warps // (block_h * block_width))
    cap = 1 << (cap.bit_length() - 1)
    return max(1, min(cap, 64, triton.next_power_of_2(max(m, 1))))


def tree_configs(block_m_caps: tuple) -> list:
    """The autotune configs: query tiles up to ``block_m_caps[i]`` (and a half and a quarter of it) with
    ``_WARPS[i]`` warps, from the smallest to the largest tile per warp count."""
    return [triton.Config({"BLOCK_M": bm}, num_warps=w, num_stages=1)
            for w, cap in zip(_WARPS, block_m_caps) for bm in sorted({max(1, cap >> shift) for shift in range(3)})]


@functools.lru_cache(maxsize=None)
def _tuned_kernel(block_m_caps: tuple):
    """The kernel autotuned over ``tree_configs(block_m_caps)`` (lazily: autotune needs a GPU driver). Under
    ``ATTN_EXT_TRITON_PIN=1`` it runs the last of them: the largest query tile with the most warps, which
    the register budget above keeps free of spills (every config is valid for the shape it was made for)."""
    return lazily_autotuned(_tree_fwd_kernel, tree_configs(block_m_caps), ["H", "D", "DV", "height", "group_size"])()


# --------------------------------------------------------------------------- wrapper

def _check_args(q, node_k, node_v, node_padding_mask, branching, height, group_size, scale, uniforms):
    """Validated ``(num_nodes, S)``; messages as the C++ op's (csrc/cpu/tree_cross_attention.cpp)."""
    for name, t in (("q", q), ("node_k", node_k), ("node_v", node_v), ("node_padding_mask", node_padding_mask)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attn_ext: {name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4 or node_k.dim() != 4 or node_v.dim() != 4:
        raise ValueError(
            "attn_ext: q, node_k, node_v must be 4-D [B, H, M, D], [B, H, num_nodes, D], [B, H, num_nodes, Dv]; "
            f"got q {tuple(q.shape)}, node_k {tuple(node_k.shape)}, node_v {tuple(node_v.shape)}")
    for name, value, low in (("branching", branching, 2), ("height", height, 0), ("group_size", group_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"attn_ext: {name} must be an int >= {low}, got {value!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"attn_ext: scale must be a finite float, got {scale!r}")
    if float(branching) ** (height + 1) * group_size >= 2.0**62:
        raise ValueError(f"attn_ext: a tree of branching {branching}, height {height} and group size "
                         f"{group_size} is too large")
    B, H, M, D = q.shape
    num_nodes = (branching ** (height + 1) - 1) // (branching - 1) + group_size * branching**height
    if (tuple(node_k.shape) != (B, H, num_nodes, D) or tuple(node_v.shape[:3]) != (B, H, num_nodes)):
        raise ValueError(
            f"attn_ext: node_k must be [B, H, num_nodes, D] = {[B, H, num_nodes, D]} and node_v "
            f"[B, H, num_nodes, Dv] for q {tuple(q.shape)} and a tree with branching {branching}, height "
            f"{height}, group size {group_size}; got node_k {tuple(node_k.shape)}, node_v {tuple(node_v.shape)}")
    if D == 0 or H == 0:
        # The policy is a mean over heads: without a head it is undefined (0/0).
        raise ValueError(f"attn_ext: head dim D and heads H must be positive, got q {tuple(q.shape)}")
    if not (q.dtype == node_k.dtype == node_v.dtype):
        raise TypeError(f"attn_ext: q, node_k, node_v must share a dtype; got {q.dtype}, {node_k.dtype}, "
                        f"{node_v.dtype}")
    if q.dtype == torch.float64:
        raise TypeError("attn_ext: the Triton backend does not support float64; use the cpp or reference backend")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"attn_ext: the Triton backend supports float32/float16/bfloat16, got {q.dtype}")
    if node_padding_mask.dtype != torch.bool:
        raise TypeError(f"attn_ext: node_padding_mask must be bool (True = padding), got {node_padding_mask.dtype}")
    if tuple(node_padding_mask.shape) != (B, num_nodes):
        raise ValueError(f"attn_ext: node_padding_mask must be [B, num_nodes] = {[B, num_nodes]}, got "
                         f"{list(node_padding_mask.shape)}")
    tensors = [q, node_k, node_v, node_padding_mask]
    if uniforms is not None:
        if not isinstance(uniforms, torch.Tensor) or not uniforms.is_floating_point():
            got = uniforms.dtype if isinstance(uniforms, torch.Tensor) else type(uniforms).__name__
            raise TypeError(f"attn_ext: uniforms must be a floating tensor, got {got}")
        if tuple(uniforms.shape) != (B, M, height):
            raise ValueError(f"attn_ext: uniforms must be [B, M, height] = {[B, M, height]}, got "
                             f"{list(uniforms.shape)}")
        tensors.append(uniforms)
    check_device(_tree_fwd_kernel, *tensors)
    return num_nodes, height * (branching - 1) + group_size


def tree_cross_attention_fwd_triton(q, node_k, node_v, node_padding_mask, branching, height, group_size, scale,
                                    uniforms=None):
    """Fused Tree Cross Attention forward (Triton): descend, select, attend, in one pass per query.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, H, M, D]`` queries; any strides.
    node_k, node_v : torch.Tensor
        ``[B, H, num_nodes, D]`` / ``[B, H, num_nodes, Dv]`` keys and values of every node, in the id
        layout of :mod:`attn_ext.ops.tree.build` (``num_nodes = G + P·b^k``); any strides. q, node_k, node_v
        share one dtype among float32, float16, bfloat16 (float64: ``TypeError``, use the C++ op).
    node_padding_mask : torch.Tensor
        Bool ``[B, num_nodes]``, True = padding (``Tree.node_padding_mask``).
    branching, height, group_size : int
        ``b >= 2``, ``k >= 0``, ``P >= 1`` of the tree.
    scale : float
        Multiplier of ``q·k`` (scores of the policy and of the attention alike).
    uniforms : torch.Tensor, optional
        ``[B, M, height]`` draws in [0, 1) for the ``"sample"`` policy (inverse CDF, as
        :func:`attn_ext.ops.tree.naive._inverse_cdf`); ``None`` for greedy (argmax, ties to the first child).

    Returns
    -------
    out : torch.Tensor
        ``[B, H, M, Dv]`` in q's dtype (accumulated in fp32); 0 for a row with no valid selected node.
    lse : torch.Tensor
        fp32 ``[B, H, M]``, natural log; ``-inf`` for a row with no valid selected node.
    selected : torch.Tensor
        int64 ``[B, M, S]``, ``S = height·(b − 1) + P``: the rejected children level by level (child
        order, the chosen one skipped), then the ``P`` leaf ids of the chosen group.
    log_prob, entropy : torch.Tensor
        fp32 ``[B, M]``: ``Σ_levels log π(choice)`` and ``Σ_levels H(π)``.

    Raises
    ------
    ValueError, TypeError, RuntimeError
        Bad shapes or tree parameters, unsupported or mismatched dtypes, devices the kernel cannot run on.

    Notes
    -----
    Matches ``torch.ops.attn_ext.tree_cross_attention_fwd`` up to float rounding (same choices from
    the same uniforms, barring exact ties). Fixed tiles under ``TRITON_INTERPRET=1``; on CUDA the
    query tile and warps are autotuned per (H, D, Dv, height, P).
    """
    _, S = _check_args(q, node_k, node_v, node_padding_mask, branching, height, group_size, scale, uniforms)
    B, H, M, D = q.shape
    DV = node_v.shape[3]
    device = q.device
    out = torch.empty((B, H, M, DV), dtype=q.dtype, device=device)
    lse = torch.empty((B, H, M), dtype=torch.float32, device=device)
    selected = torch.empty((B, M, S), dtype=torch.int64, device=device)
    log_prob = torch.empty((B, M), dtype=torch.float32, device=device)
    entropy = torch.empty((B, M), dtype=torch.float32, device=device)
    if B * M == 0:
        return out, lse, selected, log_prob, entropy  # an empty launch grid is an error in Triton
    # bool loads as i1, which some Triton paths treat awkwardly; uint8 is a free view.
    mask = node_padding_mask.contiguous().view(torch.uint8)
    sample = uniforms is not None
    u = uniforms.to(device=device, dtype=torch.float32) if sample else log_prob  # never read when greedy
    group_offset = (branching**height - 1) // (branching - 1)
    leaf_offset = (branching ** (height + 1) - 1) // (branching - 1)
    block_h, block_d, block_dv = (triton.next_power_of_2(max(x, 1)) for x in (H, D, DV))  # Dv = 0: no column
    args = (q, node_k, node_v, mask, u, out, lse, selected, log_prob, entropy,
            *q.stride(), *node_k.stride(), *node_v.stride(), *mask.stride(),
            *(u.stride() if sample else (0, 0, 0)), *out.stride(), *lse.stride(), *selected.stride(),
            H, M, D, DV, height, group_size, group_offset, leaf_offset, float(scale))
    meta = dict(BRANCH=branching, SAMPLE=sample, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_DV=block_dv,
                BLOCK_B=triton.next_power_of_2(branching), BLOCK_P=min(triton.next_power_of_2(group_size), 16))
    if interpreting():
        # Each interpreted op is a numpy call over the whole tile: a modest fixed query tile.
        block_m = min(16, triton.next_power_of_2(M))
        _tree_fwd_kernel[(triton.cdiv(M, block_m), B)](*args, BLOCK_M=block_m, **meta)
    else:
        caps = tuple(_block_m_cap(M, block_h, max(block_d, block_dv), w) for w in _WARPS)
        _tuned_kernel(caps)[lambda META: (triton.cdiv(M, META["BLOCK_M"]), B)](*args, **meta)
    return out, lse, selected, log_prob, entropy
