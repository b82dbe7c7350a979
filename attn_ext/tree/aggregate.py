"""Bottom-up aggregation of leaf values into node values (SPEC §3 "Aggregate").

Two implementations of the masked mean: the fused C++ op ``attn_ext::tree_aggregate_fwd``
(csrc/cpu/tree_aggregate.cpp, one depth-first pass; its fake kernel and autograd are in
:mod:`attn_ext.tree.aggregate_ops`) and the vectorised PyTorch reference below, level by level, which also
runs any callable reducer.
"""
from __future__ import annotations

import os
from typing import Callable, Optional, Union

import torch
from torch import Tensor

from attn_ext.tree.build import Tree

Reducer = Callable[[Tensor, Tensor], Tensor]


def masked_mean(children: Tensor, padding_mask: Tensor) -> Tensor:
    """Mean of ``children [..., c, E]`` over the non-padding ones (``padding_mask [..., c]``, True = padding).

    All-padding rows give 0 rather than NaN (the count is clamped), so no NaN reaches the gradients.
    """
    weight = (~padding_mask).to(children.dtype).unsqueeze(-1)
    return (children * weight).sum(dim=-2) / weight.sum(dim=-2).clamp(min=1)


_REDUCERS = {"mean": masked_mean}
AGGREGATE_BACKENDS = ("cpp", "cuda", "reference")
_CPP_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def tree_aggregate(
    tree: Tree, leaf_values: Tensor, reduce: Union[str, Reducer] = "mean", *, backend: Optional[str] = None
) -> Tensor:
    """Values of every node of ``tree``: the leaves' own values, and ``reduce`` of the children above.

    Parameters
    ----------
    tree : Tree
        From :func:`build_tree`.
    leaf_values : Tensor
        ``[B, N, E]`` in the **caller's token order** (the tree applies its permutation).
    reduce : "mean" or callable
        ``"mean"``: masked mean of the valid children (SPEC §3 default). A callable gets
        ``(children [B, n, c, E], padding_mask [B, n, c])`` (True = padding child, the
        ``key_padding_mask`` convention, so an ``nn.MultiheadAttention`` can use it directly;
        ``c = P`` for the group nodes, ``b`` above) and returns ``[B, n, E]``. Rows whose children are
        all padding are zeroed afterwards, but the callable must not produce NaN for them (NaN would
        leak into the gradients through ``torch.where``).
    backend : {"cpp", "cuda", "reference", "auto"}, optional
        ``"cpp"``: the fused C++ kernel (``reduce="mean"`` on CPU, float16/bfloat16/float32/float64;
        fp32 sums for the half types); ``"cuda"``: the same op's CUDA kernel (CUDA builds only);
        ``"reference"``: the PyTorch code, level by level. None or ``"auto"`` follows
        ``ATTN_EXT_BACKEND`` when it names one of these, else takes the compiled kernel of the
        device where it can run and the reference elsewhere. Callable reducers always run on the
        reference; a forced compiled backend that cannot run raises ``RuntimeError``.

    Returns
    -------
    Tensor
        ``[B, tree.num_nodes, E]`` in node-id order (see :mod:`attn_ext.tree.build`); padding nodes,
        padding leaf slots and masked tokens are 0.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.tree import build_tree, tree_aggregate
    >>> tree = build_tree(torch.tensor([[3.0, 1.0, 2.0, 0.0]]), branching=2)   # k = 1, P = 2
    >>> values = torch.tensor([[[30.0], [10.0], [20.0], [0.0]]])
    >>> tree_aggregate(tree, values).flatten().tolist()   # root, 2 groups, 4 leaves in key order
    [15.0, 5.0, 25.0, 0.0, 10.0, 20.0, 30.0]
    """
    reducer = _resolve_reducer(reduce)
    _check_leaf_values(tree, leaf_values)
    if _select_backend(backend, reduce, leaf_values) in ("cpp", "cuda"):
        # Its fake kernel and autograd are registered by attn_ext.tree, which imports attn_ext.tree.aggregate_ops.
        return torch.ops.attn_ext.tree_aggregate_fwd(leaf_values, tree.leaf_token, tree.node_padding_mask,
                                                          tree.branching, tree.height, tree.group_size)
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


def _select_backend(requested: Optional[str], reduce: Union[str, Reducer], leaf_values: Tensor) -> str:
    """``"cpp"``, ``"cuda"`` or ``"reference"`` for this call (see ``backend`` of :func:`tree_aggregate`)."""
    from attn_ext.backends import ENVIRONMENT_VARIABLE, rejection_reasons

    if requested is not None and requested != "auto" and requested not in AGGREGATE_BACKENDS:
        raise ValueError(
            f"attn_ext: unknown backend {requested!r} for tree_aggregate; choose one of "
            f"{', '.join(AGGREGATE_BACKENDS)} or 'auto'"
        )
    if not isinstance(reduce, str):
        if requested in ("cpp", "cuda"):
            raise RuntimeError(f"attn_ext: backend {requested!r} of tree_aggregate runs reduce='mean' only, "
                               "not a callable")
        return "reference"
    if requested is None or requested == "auto":
        env = os.environ.get(ENVIRONMENT_VARIABLE)
        requested = env if env in AGGREGATE_BACKENDS else "auto"
    if requested == "reference":
        return requested
    compiled = requested if requested != "auto" else ("cuda" if leaf_values.device.type == "cuda" else "cpp")
    reason = rejection_reasons(leaf_values, "attn_ext::tree_aggregate_fwd")[compiled]
    if reason is None and leaf_values.dtype not in _CPP_DTYPES:
        reason = f"the kernel takes float16, bfloat16, float32 or float64, not {leaf_values.dtype}"
    if requested == compiled and reason is not None:
        raise RuntimeError(f"attn_ext: backend {compiled!r} cannot run tree_aggregate on {leaf_values.device} "
                           f"{leaf_values.dtype} leaf values ({reason})")
    return compiled if reason is None else "reference"


def _resolve_reducer(reduce: Union[str, Reducer]) -> Reducer:
    if isinstance(reduce, str):
        if reduce not in _REDUCERS:
            raise ValueError(
                f"attn_ext: unknown reduce {reduce!r}; choose one of {sorted(_REDUCERS)} or pass a callable"
            )
        return _REDUCERS[reduce]
    if not callable(reduce):
        raise TypeError(f"attn_ext: reduce must be a string or a callable, got {type(reduce).__name__}")
    return reduce


def _check_leaf_values(tree: Tree, leaf_values: Tensor) -> None:
    if not isinstance(leaf_values, Tensor):
        raise TypeError(f"attn_ext: leaf_values must be a torch.Tensor, got {type(leaf_values).__name__}")
    expected = (tree.batch_size, tree.num_tokens)
    if leaf_values.dim() != 3 or tuple(leaf_values.shape[:2]) != expected:
        raise ValueError(
            f"attn_ext: leaf_values must be [B, N, E] with [B, N] = {list(expected)} of the tree, "
            f"got {tuple(leaf_values.shape)}"
        )
    if leaf_values.device != tree.device:
        raise RuntimeError(f"attn_ext: leaf_values are on {leaf_values.device} but the tree is on {tree.device}")
