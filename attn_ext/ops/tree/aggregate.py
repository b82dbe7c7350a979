"""Bottom-up aggregation of leaf values into node values (docs/spec.md §3 "Aggregate").

Two implementations of the masked mean: the compiled op ``attn_ext::tree_aggregate_fwd`` (one
depth-first pass; its fake kernel and autograd are in :mod:`.registration`) and the vectorised PyTorch
reference of :mod:`.naive`, level by level, which also runs any callable reducer.
"""
from __future__ import annotations

from typing import Optional, Union

from torch import Tensor

from attn_ext.ops.tree.build import Tree
from attn_ext.ops.tree.naive import Reducer, masked_mean, tree_aggregate_reference
from attn_ext.ops.tree.registration import TREE_AGGREGATE
from attn_ext.ops.utils import dispatch

_REDUCERS = {"mean": masked_mean}


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
        ``"mean"``: masked mean of the valid children (docs/spec.md §3 default). A callable gets
        ``(children [B, n, c, E], padding_mask [B, n, c])`` (True = padding child, the
        ``key_padding_mask`` convention, so an ``nn.MultiheadAttention`` can use it directly;
        ``c = P`` for the group nodes, ``b`` above) and returns ``[B, n, E]``. Rows whose children are
        all padding are zeroed afterwards, but the callable must not produce NaN for them (NaN would
        leak into the gradients through ``torch.where``).
    backend : {"cpp", "cuda", "reference", "auto"}, optional
        ``"cpp"``: the fused C++ kernel (``reduce="mean"`` on CPU, float16/bfloat16/float32/float64;
        fp32 sums for the half types); ``"cuda"``: the same op's CUDA kernel (CUDA builds only);
        ``"reference"``: the PyTorch code, level by level. Chosen as for
        :func:`attn_ext.cross_attention` (there is no Triton kernel: ``ATTN_EXT_BACKEND=triton`` is
        ignored here). Callable reducers run on the reference; a forced backend that cannot run
        raises ``RuntimeError`` listing every backend's reason.

    Returns
    -------
    Tensor
        ``[B, tree.num_nodes, E]`` in node-id order (see :mod:`attn_ext.ops.tree.build`); padding nodes,
        padding leaf slots and masked tokens are 0.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.ops.tree import build_tree, tree_aggregate
    >>> tree = build_tree(torch.tensor([[3.0, 1.0, 2.0, 0.0]]), branching=2)   # k = 1, P = 2
    >>> values = torch.tensor([[[30.0], [10.0], [20.0], [0.0]]])
    >>> tree_aggregate(tree, values).flatten().tolist()   # root, 2 groups, 4 leaves in key order
    [15.0, 5.0, 25.0, 0.0, 10.0, 20.0, 30.0]
    """
    reducer = _resolve_reducer(reduce)
    _check_leaf_values(tree, leaf_values)
    name = dispatch.select_backend(TREE_AGGREGATE, backend, leaf_values, reduce=reduce)
    if name != "reference":
        return dispatch.entry(TREE_AGGREGATE, name)(leaf_values, tree.leaf_token, tree.node_padding_mask,
                                                     tree.branching, tree.height, tree.group_size)
    return tree_aggregate_reference(tree, leaf_values, reducer)


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
