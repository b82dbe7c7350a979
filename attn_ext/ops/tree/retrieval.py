"""Retrieval + attention of Tree Cross Attention (docs/spec.md §3 "Retrieve", "Attend"): the public op.

The fused kernels (``attn_ext::tree_cross_attention_fwd`` / ``_bwd`` for CPU and CUDA, and their
Triton twins) descend and attend in one pass per query; the readable reference is :mod:`.naive`.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from attn_ext.ops.attention import cross_attention
from attn_ext.ops.tree.build import Tree
from attn_ext.ops.tree.naive import TreeAttentionResult, tree_cross_attention_reference
from attn_ext.ops.tree.registration import TREE_CROSS_ATTENTION
from attn_ext.ops.utils import dispatch
from attn_ext.ops.utils.dtypes import accumulation_dtype
from attn_ext.ops.utils.validation import is_real_scalar

POLICIES = ("greedy", "sample", "full")


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
    over the heads (docs/spec.md §3; the paper shares the policy's weights with the cross attention). One
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
    >>> from attn_ext.ops.tree import build_tree, tree_aggregate, tree_cross_attention
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
    name = dispatch.select_backend(TREE_CROSS_ATTENTION, backend, q)
    uniforms = _draw_uniforms(q, tree, generator) if policy == "sample" else None
    if name != "reference":
        return _tree_cross_attention_fused(name, q, node_k, node_v, tree, policy, scale, uniforms)
    return tree_cross_attention_reference(q, node_k, node_v, tree, policy, scale, uniforms)


def _draw_uniforms(q: Tensor, tree: Tree, generator: Optional[torch.Generator]) -> Tensor:
    """The ``[B, M, height]`` uniforms of a ``"sample"`` descent (fp32, fp64 for fp64 inputs)."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, _, M, _ = q.shape
    return torch.rand(B, M, tree.height, generator=generator, device=q.device, dtype=dtype)


def _tree_cross_attention_fused(backend, q, node_k, node_v, tree, policy, scale, uniforms) -> TreeAttentionResult:
    B, H, M, _ = q.shape
    acc_dtype = accumulation_dtype(q.dtype)
    if policy == "full":
        G = tree.leaf_offset
        selected = torch.arange(G, tree.num_nodes, device=q.device).expand(B, M, tree.num_leaves)
        out = cross_attention(q, node_k[:, :, G:], node_v[:, :, G:], key_padding_mask=tree.node_padding_mask[:, G:],
                              scale=scale, backend=backend)
        zero = q.new_zeros(B, M, dtype=acc_dtype)
        return TreeAttentionResult(out, selected, zero, zero)
    op = dispatch.entry(TREE_CROSS_ATTENTION, backend)
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
        raise ValueError(f"attn_ext.tree_cross_attention: head dim D must be positive, got q {tuple(q.shape)}")
    if H == 0:  # the policy is the mean over the heads of their attention weights: 0/0 without a head
        raise ValueError(f"attn_ext.tree_cross_attention: heads H must be positive (the policy averages the heads' "
                         f"attention weights), got q {tuple(q.shape)}")
    if not (q.dtype == node_k.dtype == node_v.dtype) or not q.is_floating_point():
        raise TypeError(
            f"attn_ext: q, node_k, node_v must share a floating dtype; got {q.dtype}, {node_k.dtype}, {node_v.dtype}"
        )
    if not (q.device == node_k.device == node_v.device == tree.device):
        raise RuntimeError(
            f"attn_ext: q, node_k, node_v and the tree must be on one device; "
            f"got {q.device}, {node_k.device}, {node_v.device}, tree on {tree.device}"
        )
    bad_scale = not is_real_scalar(scale) or not math.isfinite(scale)
    if scale is not None and bad_scale:
        raise ValueError(f"attn_ext: scale must be a finite float, got {scale!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"attn_ext: generator must be a torch.Generator, got {type(generator).__name__}")
