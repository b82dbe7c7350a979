"""Readable PyTorch reference of the tree family (docs/spec.md §3): aggregation level by level, and the
descent + attention of Tree Cross Attention.

Vectorised over batch, heads and queries; the only loops are over the levels of the tree. The
selected set's keys and values are materialised here (``[B, H, M, |S|, D]``), which the fused kernels
avoid. :func:`path_forward` is the reference math on a given selected set, against which the fused
backward is tested.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from attn_ext.ops.tree.build import Tree

Reducer = Callable[[Tensor, Tensor], Tensor]


def masked_mean(children: Tensor, padding_mask: Tensor) -> Tensor:
    """Mean of ``children [..., c, E]`` over the non-padding ones (``padding_mask [..., c]``, True = padding).

    All-padding rows give 0 rather than NaN (the count is clamped), so no NaN reaches the gradients.
    Padding children are selected away, not multiplied by 0, so a NaN there does not propagate; a
    NaN in a valid child does.
    """
    pad = padding_mask.unsqueeze(-1)
    count = (~pad).to(children.dtype).sum(dim=-2).clamp(min=1)
    return torch.where(pad, torch.zeros((), dtype=children.dtype, device=children.device), children).sum(dim=-2) / count



def tree_aggregate_reference(tree: Tree, leaf_values: Tensor, reducer: Reducer) -> Tensor:
    """Values of every node ``[B, tree.num_nodes, E]``: see :func:`attn_ext.tree_aggregate`."""
    B, E = leaf_values.shape[0], leaf_values.shape[2]
    b, k, P = tree.branching, tree.height, tree.group_size
    G = tree.leaf_offset
    pad = tree.node_padding_mask

    gathered = leaf_values.gather(1, tree.leaf_token.clamp(min=0).unsqueeze(-1).expand(B, tree.num_leaves, E))
    leaves = gathered.masked_fill(pad[:, G:, None], 0)

    # Bottom-up: the groups reduce their P leaves, each level above its b children.
    levels = [_reduce_level(reducer, leaves.view(B, b**k, P, E), pad[:, G:].view(B, b**k, P), pad, tree, k)]
    for level in range(k - 1, -1, -1):
        below = tree.level_offset(level + 1)
        child_pad = pad[:, below : below + b ** (level + 1)].view(B, b**level, b)
        levels.append(_reduce_level(reducer, levels[-1].view(B, b**level, b, E), child_pad, pad, tree, level))
    return torch.cat([*reversed(levels), leaves], dim=1)



def _reduce_level(reducer: Reducer, children: Tensor, child_pad: Tensor, pad: Tensor, tree: Tree, level: int) -> Tensor:
    B, n, _, E = children.shape
    out = reducer(children, child_pad)
    if not isinstance(out, Tensor) or tuple(out.shape) != (B, n, E):
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(
            f"attn_ext: tree_aggregate's reduce must return [B, n, E] = {[B, n, E]} at level {level}, got {got}"
        )
    start = tree.level_offset(level)
    return out.masked_fill(pad[:, start : start + n, None], 0)


class TreeAttentionResult(NamedTuple):
    """Output of :func:`tree_cross_attention`.

    Attributes
    ----------
    out : Tensor
        ``[B, H, M, Dv]``: attention of each query over its selected nodes, in the input dtype
        (computed in fp32 for fp16/bf16 inputs, docs/spec.md §0).
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


def tree_cross_attention_reference(q: Tensor, node_k: Tensor, node_v: Tensor, tree: Tree, policy: str, scale: float,
                                   uniforms: Optional[Tensor]) -> TreeAttentionResult:
    """The descent and attention of :func:`attn_ext.tree_cross_attention`, level by level."""
    out_dtype = q.dtype
    if q.dtype in (torch.float16, torch.bfloat16):  # docs/spec.md §0: accumulate in fp32, return the input dtype
        q, node_k, node_v = q.float(), node_k.float(), node_v.float()
    B, H, M, _ = q.shape
    pad = tree.node_padding_mask
    if policy == "full":
        G = tree.leaf_offset
        # Every query reads the same leaves: a broadcast view of ids, dense attention (no per-query gather).
        selected = torch.arange(G, tree.num_nodes, device=q.device).expand(B, M, tree.num_leaves)
        leaf_pad = pad[:, None, None, G:]
        scores = torch.matmul(q, node_k[:, :, G:].transpose(-1, -2)) * scale
        weights = _masked_softmax(scores, leaf_pad)
        out = torch.matmul(weights, node_v[:, :, G:].masked_fill(leaf_pad.transpose(-1, -2), 0)).to(out_dtype)
        zero = q.new_zeros(B, M)
        return TreeAttentionResult(out, selected, zero, zero)

    b = tree.branching
    arange_b = torch.arange(b, device=q.device)
    current = torch.zeros(B, M, dtype=torch.long, device=q.device)  # every descent starts at the root
    rejected, log_prob, entropy = [], q.new_zeros(B, M), q.new_zeros(B, M)
    descent_nan = torch.zeros(B, M, dtype=torch.bool, device=q.device)
    for level in range(tree.height):
        children = current.unsqueeze(-1) * b + 1 + arange_b  # heap layout, see attn_ext.ops.tree.build
        pi = _policy(q, node_k, pad, children, scale)  # [B, M, b]; padding children have exactly 0
        if policy == "greedy":
            action = pi.detach().argmax(dim=-1)
        else:
            action = _inverse_cdf(pi.detach(), uniforms[:, :, level].to(pi.dtype))
        # A NaN policy cannot choose: follow the first valid child, as the kernels do (docs/tree.md).
        step_nan = pi.detach().isnan().any(dim=-1)
        first_valid = (~pad.gather(1, children.view(B, M * b)).view(B, M, b)).int().argmax(dim=-1)
        action = torch.where(step_nan, first_valid, action)
        descent_nan = descent_nan | step_nan
        step_log_prob, step_entropy = _step_statistics(pi, action)
        log_prob, entropy = log_prob + step_log_prob, entropy + step_entropy
        # Positions 0..b-2 skip the chosen one: a gather keeps the shapes data-independent (meta, compile).
        others = arange_b[:-1] + (arange_b[:-1] >= action.unsqueeze(-1)).long()
        rejected.append(children.gather(-1, others))
        current = children.gather(-1, action.unsqueeze(-1)).squeeze(-1)

    group = current - tree.level_offset(tree.height)
    leaves = tree.leaf_offset + group.unsqueeze(-1) * tree.group_size + torch.arange(tree.group_size, device=q.device)
    selected = torch.cat([*rejected, leaves], dim=-1)
    out = _attend(q, node_k, node_v, pad, selected, scale)[0]
    # After a NaN step the path is arbitrary: every output of the query is NaN.
    nan = torch.full((), math.nan, dtype=out.dtype, device=out.device)
    out = torch.where(descent_nan[:, None, :, None], nan, out).to(out_dtype)
    log_prob, entropy = torch.where(descent_nan, nan, log_prob), torch.where(descent_nan, nan, entropy)
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
    weights = _masked_softmax(scores, sel_pad)
    empty = sel_pad.all(dim=-1)
    lse = torch.where(empty, -math.inf, torch.logsumexp(scores.masked_fill(sel_pad, -math.inf), dim=-1))
    # NaN weights (a NaN or +inf score, or valid scores all −inf) make lse NaN too, as the kernels.
    lse = torch.where(weights.isnan().any(dim=-1), math.nan, lse)
    values = values.masked_fill(sel_pad.unsqueeze(-1), 0)  # 0·NaN would leak a padding node's value
    return torch.einsum("bhms,bhmsd->bhmd", weights, values), lse


def _masked_softmax(scores: Tensor, padding: Tensor) -> Tensor:
    """Softmax over the last dim without the ``padding`` entries (weight 0); an all-padding row is 0.

    The padding scores are replaced (not masked by a product), so NaN there never reaches the row;
    an all-padding row softmaxes zeros, so that neither its output nor its gradient is NaN.
    """
    empty = padding.all(dim=-1, keepdim=True)
    fill = torch.where(empty, 0.0, -math.inf).to(scores.dtype)
    return torch.softmax(torch.where(padding, fill, scores), dim=-1).masked_fill(padding, 0)


def _policy(q: Tensor, node_k: Tensor, pad: Tensor, children: Tensor, scale: float) -> Tensor:
    """``π [B, M, b]``: head mean of the per-head softmax of the query over the valid ``children [B, M, b]``."""
    B, M, b = children.shape
    child_pad = pad.gather(1, children.view(B, M * b)).view(B, M, b)
    logits = torch.einsum("bhmd,bhmcd->bhmc", q, _gather_nodes(node_k, children)) * scale
    # π = 0 at a node without valid children (a malformed mask), as the kernels; NaN if a valid
    # child's score is non-finite in a way that makes torch.softmax NaN.
    return _masked_softmax(logits, child_pad[:, None]).mean(dim=1)


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
        pi = _masked_softmax(logits, child_pad).mean(dim=1)  # [B, M, k, b]
        action = torch.stack(path[1:], dim=-1) - children[..., 0]  # [B, M, k]
        step_log_prob, step_entropy = _step_statistics(pi, action)
        log_prob, entropy = step_log_prob.sum(dim=-1), step_entropy.sum(dim=-1)
    out, lse = _attend_gathered(q, keys[:, :, :, height * b:], _gather_nodes(node_v, selected),
                                id_pad[..., height * b:], scale)
    return out.to(out_dtype), lse, log_prob, entropy
