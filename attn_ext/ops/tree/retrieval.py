"""Retrieval + attention of Tree Cross Attention (SPEC §3 "Retrieve", "Attend"): readable reference.

Vectorised over batch, heads and queries; the only loop is over the ``k`` levels of the descent.
The selected set's keys and values are materialised here (``[B, H, M, |S|, D]``), which the fused
C++ kernels (``attn_ext::tree_cross_attention_fwd`` / ``_bwd``, csrc/cpu/tree_cross_attention*.cpp)
avoid. :func:`path_forward` is the reference math on a given selected set, against which the fused
backward is tested.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from attn_ext.tree.build import Tree

POLICIES = ("greedy", "sample", "full")


class TreeAttentionResult(NamedTuple):
    """Output of :func:`tree_cross_attention`.

    Attributes
    ----------
    out : Tensor
        ``[B, H, M, Dv]``: attention of each query over its selected nodes, in the input dtype
        (computed in fp32 for fp16/bf16 inputs, SPEC §0).
    selected : Tensor
        Long ``[B, M, S]`` node ids (``S = tree.num_selected``; for ``"full"`` all ``tree.num_leaves``
        leaf ids, as a broadcast view since every query reads the same leaves):
        the rejected children level by level (``b − 1`` per level, root first), then the ``P`` leaves
        of the chosen group. Ids of padding nodes may appear; they are masked in the attention.
    log_prob : Tensor
        ``[B, M]``, ``Σ_t log π(a_t | s_t)`` over the ``k`` levels (0 for ``"full"``), differentiable;
        fp32 for fp16/bf16 inputs, else the input dtype.
    entropy : Tensor
        ``[B, M]``, ``Σ_t H(π(· | s_t))`` (0 for ``"full"``), differentiable; dtype as ``log_prob``.
    """

    out: Tensor
    selected: Tensor
    log_prob: Tensor
    entropy: Tensor


def tree_cross_attention(
    q: Tensor,
    node_k: Tensor,
    node_v: Tensor,
    tree: Tree,
    *,
    policy: str = "greedy",
    scale: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
    backend: Optional[str] = None,
) -> TreeAttentionResult:
    """Each query descends the tree, keeps ``O(log N)`` nodes and attends over them (TCA, Algorithm 1).

    At a node ``v`` the policy is ``π(c) = mean_h softmax_c(scale · q_h · k_{h,c})`` over the valid
    children ``c`` of ``v`` — the per-head attention weights of the query over the children, averaged
    over the heads (SPEC §3; the paper shares the policy's weights with the cross attention). One
    child is chosen (argmax for ``"greedy"``, ties to the first child; a draw for ``"sample"``); the
    ``b − 1`` others join the selected set S, and the descent continues; at the group level the
    ``P`` leaf tokens of the chosen group join S. Finally the query attends (softmax, per head) over
    the valid nodes of S.

    Parameters
    ----------
    q : Tensor
        ``[B, H, M, D]`` queries.
    node_k, node_v : Tensor
        ``[B, H, tree.num_nodes, D]`` and ``[B, H, tree.num_nodes, Dv]``: keys/values of every node
        in node-id order, e.g. heads of :func:`tree_aggregate` outputs.
    tree : Tree
        From :func:`build_tree`, on the device of ``q``.
    policy : {"greedy", "sample", "full"}
        ``"full"`` attends over all valid leaves (the L_CA term, ReTreever-Full); its ``log_prob``
        and ``entropy`` are 0.
    scale : float, optional
        Score scale of both the policy and the attention, default ``1/sqrt(D)``.
    generator : torch.Generator, optional
        Source of the draws of ``"sample"``, on the device of ``q``, for reproducibility. The draws are
        ``[B, M, height]`` uniforms (``torch.rand``, fp32, fp64 for fp64 inputs) turned into children by
        inverse CDF of π at each level, identically on every backend: the same generator state gives
        the same paths.
    backend : {"cpp", "cuda", "triton", "reference", "auto"}, optional
        As for :func:`attn_ext.cross_attention` (``backend=``, else ``ATTN_EXT_BACKEND``, else CPU:
        the fused C++ kernels, CUDA: the fused Triton kernels, the reference below as last resort).
        For ``"full"`` the fused backends run :func:`attn_ext.cross_attention` over the leaves. A
        forced backend that cannot run raises ``RuntimeError`` listing why.

    Returns
    -------
    TreeAttentionResult
        ``(out, selected, log_prob, entropy)``. Gradients reach ``q``, ``node_k`` and ``node_v``
        through ``out``, and ``q``/``node_k`` through ``log_prob`` and ``entropy``; the discrete
        choices themselves are not differentiated (REINFORCE uses ``log_prob``).

    Examples
    --------
    >>> import torch
    >>> from attn_ext.tree import build_tree, tree_aggregate, tree_cross_attention
    >>> B, N, H, D = 2, 128, 4, 8
    >>> tree = build_tree(torch.rand(B, N, 1))
    >>> nodes = tree_aggregate(tree, torch.randn(B, N, 2 * H * D))            # keys and values
    >>> node_k, node_v = nodes.view(B, -1, 2, H, D).permute(2, 0, 3, 1, 4)   # each [B, H, nodes, D]
    >>> res = tree_cross_attention(torch.randn(B, H, 5, D), node_k, node_v, tree)
    >>> res.out.shape, res.selected.shape, res.log_prob.shape              # 8 of 128 tokens read
    (torch.Size([2, 4, 5, 8]), torch.Size([2, 5, 8]), torch.Size([2, 5]))
    """
    _check_args(q, node_k, node_v, tree, policy, scale, generator)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    name = _select_tree_backend(backend, q)
    uniforms = _draw_uniforms(q, tree, generator) if policy == "sample" else None
    if name in ("cpp", "cuda", "triton"):
        return _tree_cross_attention_fused(name, q, node_k, node_v, tree, policy, scale, uniforms)
    out_dtype = q.dtype
    if q.dtype in (torch.float16, torch.bfloat16):  # SPEC §0: accumulate in fp32, return the input dtype
        q, node_k, node_v = q.float(), node_k.float(), node_v.float()
    B, H, M, _ = q.shape
    pad = tree.node_padding_mask
    if policy == "full":
        G = tree.leaf_offset
        # Every query reads the same leaves: a broadcast view of ids, dense attention (no per-query gather).
        selected = torch.arange(G, tree.num_nodes, device=q.device).expand(B, M, tree.num_leaves)
        leaf_pad = pad[:, None, None, G:]
        scores = torch.matmul(q, node_k[:, :, G:].transpose(-1, -2)) * scale
        weights = torch.softmax(scores.masked_fill(leaf_pad, -math.inf), dim=-1)
        out = torch.matmul(weights, node_v[:, :, G:]).to(out_dtype)
        zero = q.new_zeros(B, M)
        return TreeAttentionResult(out, selected, zero, zero)

    b = tree.branching
    arange_b = torch.arange(b, device=q.device)
    current = torch.zeros(B, M, dtype=torch.long, device=q.device)  # every descent starts at the root
    rejected, log_prob, entropy = [], q.new_zeros(B, M), q.new_zeros(B, M)
    for level in range(tree.height):
        children = current.unsqueeze(-1) * b + 1 + arange_b  # heap layout, see attn_ext.tree.build
        pi = _policy(q, node_k, pad, children, scale)  # [B, M, b]; padding children have exactly 0
        if policy == "greedy":
            action = pi.detach().argmax(dim=-1)
        else:
            action = _inverse_cdf(pi.detach(), uniforms[:, :, level].to(pi.dtype))
        step_log_prob, step_entropy = _step_statistics(pi, action)
        log_prob, entropy = log_prob + step_log_prob, entropy + step_entropy
        # Positions 0..b-2 skip the chosen one: a gather keeps the shapes data-independent (meta, compile).
        others = arange_b[:-1] + (arange_b[:-1] >= action.unsqueeze(-1)).long()
        rejected.append(children.gather(-1, others))
        current = children.gather(-1, action.unsqueeze(-1)).squeeze(-1)

    group = current - tree.level_offset(tree.height)
    leaves = tree.leaf_offset + group.unsqueeze(-1) * tree.group_size + torch.arange(tree.group_size, device=q.device)
    selected = torch.cat([*rejected, leaves], dim=-1)
    out = _attend(q, node_k, node_v, pad, selected, scale)[0].to(out_dtype)
    return TreeAttentionResult(out, selected, log_prob, entropy)


def _gather_nodes(nodes: Tensor, ids: Tensor) -> Tensor:
    """``nodes [B, H, n, D]`` at ``ids [B, M, S]`` -> ``[B, H, M, S, D]``."""
    B, H, _, D = nodes.shape
    _, M, S = ids.shape
    index = ids.reshape(B, 1, M * S, 1).expand(B, H, M * S, D)
    return nodes.gather(2, index).view(B, H, M, S, D)


def _attend(q: Tensor, node_k: Tensor, node_v: Tensor, pad: Tensor, selected: Tensor, scale: float):
    """Softmax attention of each query over its selected nodes: ``(out [B,H,M,Dv], lse [B,H,M])``."""
    B, M, S = selected.shape
    sel_pad = pad.gather(1, selected.reshape(B, M * S)).view(B, 1, M, S)
    return _attend_gathered(q, _gather_nodes(node_k, selected), _gather_nodes(node_v, selected), sel_pad, scale)


def _attend_gathered(q: Tensor, keys: Tensor, values: Tensor, sel_pad: Tensor, scale: float):
    """:func:`_attend` on gathered ``keys [B,H,M,S,D]``, ``values [B,H,M,S,Dv]`` and ``sel_pad [B,1,M,S]``."""
    scores = torch.einsum("bhmd,bhmsd->bhms", q, keys) * scale
    # S always holds a valid node (the chosen group has a valid leaf); guard anyway against NaN.
    empty = sel_pad.all(dim=-1, keepdim=True)
    masked = scores.masked_fill(sel_pad & ~empty, -math.inf)
    weights = torch.softmax(masked, dim=-1).masked_fill(sel_pad, 0)
    lse = torch.where(empty.squeeze(-1), -math.inf, torch.logsumexp(masked, dim=-1))
    return torch.einsum("bhms,bhmsd->bhmd", weights, values), lse


def _policy(q: Tensor, node_k: Tensor, pad: Tensor, children: Tensor, scale: float) -> Tensor:
    """``π [B, M, b]``: head mean of the per-head softmax of the query over the valid ``children [B, M, b]``."""
    B, M, b = children.shape
    child_pad = pad.gather(1, children.view(B, M * b)).view(B, M, b)
    logits = torch.einsum("bhmd,bhmcd->bhmc", q, _gather_nodes(node_k, children)) * scale
    # A valid node has a valid child, so each row below has a finite entry (no all -inf softmax).
    weights = torch.softmax(logits.masked_fill(child_pad[:, None], -math.inf), dim=-1)
    return weights.mean(dim=1)


def _step_statistics(pi: Tensor, action: Tensor):
    """``(log π(action), entropy of π)`` per query, both ``[B, M]`` and differentiable."""
    log_prob = torch.log(pi.gather(-1, action.unsqueeze(-1)).squeeze(-1))
    # 0·log 0 = 0 without a NaN gradient: log is taken of 1 where π = 0.
    positive = pi > 0
    entropy = -(pi * torch.log(torch.where(positive, pi, torch.ones_like(pi)))).sum(dim=-1)
    return log_prob, entropy


def _inverse_cdf(pi: Tensor, u: Tensor) -> Tensor:
    """The child drawn by uniforms ``u [B, M]`` in [0, 1) from ``pi [B, M, b]``: ``#{c : cdf_c <= u·cdf_last}``.

    Never a child with π = 0 (its cdf equals its predecessor's). The C++ kernel draws identically
    (attn_ext/tree_descent.h ``tree_choose``).
    """
    cdf = pi.cumsum(dim=-1)
    threshold = u.unsqueeze(-1) * cdf[..., -1:]
    return (cdf <= threshold).sum(dim=-1).clamp_max(pi.shape[-1] - 1)


def _draw_uniforms(q: Tensor, tree: Tree, generator: Optional[torch.Generator]) -> Tensor:
    """The ``[B, M, height]`` uniforms of a ``"sample"`` descent (fp32, fp64 for fp64 inputs)."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, _, M, _ = q.shape
    return torch.rand(B, M, tree.height, generator=generator, device=q.device, dtype=dtype)


def path_forward(q: Tensor, node_k: Tensor, node_v: Tensor, node_padding_mask: Tensor, selected: Tensor,
                 branching: int, height: int, group_size: int, scale: float):
    """The reference math on a given selected set: ``(out, lse, log_prob, entropy)``, differentiable.

    The path is read back from the ``P`` leaves at the end of ``selected`` (their group, then its
    ancestors), so only the ``k`` policies along it and the attention over ``S`` are recomputed:
    O(M·|S|·D). Differentiated by autograd it gives the reference gradients for a fixed path, which
    the fused backward kernels must match.
    """
    out_dtype = q.dtype
    if q.dtype in (torch.float16, torch.bfloat16):
        q, node_k, node_v = q.float(), node_k.float(), node_v.float()
    B, M, S = selected.shape
    b = branching
    leaf_offset = (b ** (height + 1) - 1) // (b - 1)
    group = torch.div(selected[..., S - group_size] - leaf_offset, group_size, rounding_mode="floor")
    path = [group + (b**height - 1) // (b - 1)]
    for _ in range(height):
        path.append(torch.div(path[-1] - 1, b, rounding_mode="floor"))
    path.reverse()  # path[0] is the root
    # One gather per tensor for all levels and S: each gather's backward allocates a full-size
    # node gradient, so k + 2 separate gathers would cost k + 2 passes over all nodes.
    arange_b = torch.arange(b, device=q.device)
    children = torch.stack([p.unsqueeze(-1) * b + 1 + arange_b for p in path[:-1]], dim=2) if height > 0 \
        else selected.new_empty(B, M, 0, b)  # [B, M, k, b]
    ids = torch.cat([children.view(B, M, height * b), selected], dim=-1)
    keys = _gather_nodes(node_k, ids)  # [B, H, M, k·b + S, D]
    id_pad = node_padding_mask.gather(1, ids.view(B, -1)).view(B, 1, M, height * b + S)
    log_prob, entropy = q.new_zeros(B, M), q.new_zeros(B, M)
    if height > 0:
        child_keys = keys[:, :, :, : height * b].unflatten(3, (height, b))  # [B, H, M, k, b, D]
        logits = torch.einsum("bhmd,bhmlcd->bhmlc", q, child_keys) * scale
        child_pad = id_pad[..., : height * b].unflatten(3, (height, b))
        pi = torch.softmax(logits.masked_fill(child_pad, -math.inf), dim=-1).mean(dim=1)  # [B, M, k, b]
        action = torch.stack(path[1:], dim=-1) - children[..., 0]  # [B, M, k]
        step_log_prob, step_entropy = _step_statistics(pi, action)
        log_prob, entropy = step_log_prob.sum(dim=-1), step_entropy.sum(dim=-1)
    out, lse = _attend_gathered(q, keys[:, :, :, height * b:], _gather_nodes(node_v, selected),
                                id_pad[..., height * b:], scale)
    return out.to(out_dtype), lse, log_prob, entropy


def _select_tree_backend(requested: Optional[str], q: Tensor) -> str:
    """The backend for a call on inputs like ``q``: the rules of :func:`attn_ext.cross_attention`."""
    from attn_ext.backends import select_backend

    return select_backend(requested, q, op="attn_ext::tree_cross_attention_fwd")


_FUSED_OPS = {"cpp": "tree_cross_attention_fwd", "cuda": "tree_cross_attention_fwd",
              "triton": "tree_cross_attention_fwd_triton"}


def _tree_cross_attention_fused(backend, q, node_k, node_v, tree, policy, scale, uniforms) -> TreeAttentionResult:
    B, H, M, _ = q.shape
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if policy == "full":
        from attn_ext.cross_attention import cross_attention

        G = tree.leaf_offset
        selected = torch.arange(G, tree.num_nodes, device=q.device).expand(B, M, tree.num_leaves)
        out = cross_attention(q, node_k[:, :, G:], node_v[:, :, G:], key_padding_mask=tree.node_padding_mask[:, G:],
                              scale=scale, backend=backend)
        zero = q.new_zeros(B, M, dtype=acc_dtype)
        return TreeAttentionResult(out, selected, zero, zero)
    from attn_ext.tree import ops as _tree_ops  # noqa: F401  (fake kernels and autograd of the fused ops)

    op = getattr(torch.ops.attn_ext, _FUSED_OPS[backend])
    out, _, selected, log_prob, entropy = op(
        q, node_k, node_v, tree.node_padding_mask, tree.branching, tree.height, tree.group_size, scale, uniforms
    )
    return TreeAttentionResult(out, selected, log_prob, entropy)


def _check_args(q, node_k, node_v, tree, policy, scale, generator) -> None:
    for name, t in (("q", q), ("node_k", node_k), ("node_v", node_v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"attn_ext: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(tree, Tree):
        raise TypeError(f"attn_ext: tree must be an attn_ext Tree (from build_tree), got {type(tree).__name__}")
    if policy not in POLICIES:
        raise ValueError(f"attn_ext: unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if q.dim() != 4 or node_k.dim() != 4 or node_v.dim() != 4:
        raise ValueError(
            "attn_ext: q, node_k, node_v must be 4-D [B, H, M, D], [B, H, num_nodes, D], [B, H, num_nodes, Dv]; "
            f"got q {tuple(q.shape)}, node_k {tuple(node_k.shape)}, node_v {tuple(node_v.shape)}"
        )
    B, H, _, D = q.shape
    if tree.batch_size != B:
        raise ValueError(f"attn_ext: the tree has {tree.batch_size} batch entries but q {tuple(q.shape)} has {B}")
    expected = (B, H, tree.num_nodes)
    if tuple(node_k.shape[:3]) != expected or tuple(node_v.shape[:3]) != expected or node_k.shape[3] != D:
        raise ValueError(
            f"attn_ext: node_k must be [B, H, num_nodes, D] = {[B, H, tree.num_nodes, D]} and node_v "
            f"[B, H, num_nodes, Dv] for q {tuple(q.shape)} and a tree of {tree.num_nodes} nodes over "
            f"{tree.batch_size} entries; got node_k {tuple(node_k.shape)}, node_v {tuple(node_v.shape)}"
        )
    if D == 0:
        raise ValueError(f"attn_ext: head dim D must be positive, got q {tuple(q.shape)}")
    if not (q.dtype == node_k.dtype == node_v.dtype) or not q.is_floating_point():
        raise TypeError(
            f"attn_ext: q, node_k, node_v must share a floating dtype; got {q.dtype}, {node_k.dtype}, {node_v.dtype}"
        )
    if not (q.device == node_k.device == node_v.device == tree.device):
        raise RuntimeError(
            f"attn_ext: q, node_k, node_v and the tree must be on one device; "
            f"got {q.device}, {node_k.device}, {node_v.device}, tree on {tree.device}"
        )
    bad_scale = isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
    if scale is not None and bad_scale:
        raise ValueError(f"attn_ext: scale must be a finite float, got {scale!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"attn_ext: generator must be a torch.Generator, got {type(generator).__name__}")
