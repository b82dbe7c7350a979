"""``TreeCrossAttention``: the Tree Cross Attention module of ReTreever (Feng et al.; docs/spec.md §3).

A context is organised once into a tree (:meth:`TreeCrossAttention.build`): the tokens are sorted
along their coordinates, the context embeddings are aggregated bottom-up into node embeddings, and
every node is projected to per-head keys and values. Each query then reads only
``tree_num_selected(N, b) = k(b − 1) + P`` nodes (:meth:`TreeCrossAttention.forward`), chosen by a
policy that shares its weights with the attention and is trained with REINFORCE (see
:func:`attn_ext.nn.tca_loss`). :meth:`TreeCrossAttention.forward_full` attends over all leaves with
the same weights, for the ``L_CA`` term.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor, nn

import attn_ext.ops.tree as _tree
from attn_ext.nn.tree_aggregator import AGGREGATORS, TransformerAggregator, make_reducer
from attn_ext.ops.tree import Tree
from attn_ext.ops.utils.validation import is_int_scalar


class TreeState(NamedTuple):
    """What :meth:`TreeCrossAttention.build` keeps of a context; reusable by any number of queries.

    Attributes
    ----------
    tree : Tree
        The tree over the ``N`` context tokens (:func:`attn_ext.build_tree`).
    nodes : Tensor
        ``[B, tree.num_nodes, dim]`` aggregated node embeddings, node-id order (padding nodes are 0).
    node_k, node_v : Tensor
        ``[B, num_heads, tree.num_nodes, dim / num_heads]`` per-head keys and values of the nodes.
    """

    tree: Tree
    nodes: Tensor
    node_k: Tensor
    node_v: Tensor


class TreeCrossAttentionOutput(NamedTuple):
    """Output of :meth:`TreeCrossAttention.forward`.

    Attributes
    ----------
    out : Tensor
        ``[B, M, dim]``.
    log_prob : Tensor
        ``[B, M]``, ``Σ_t log π(a_t | s_t)`` of the descent (0 for ``policy="full"``); for REINFORCE.
    entropy : Tensor
        ``[B, M]``, ``Σ_t H(π(· | s_t))`` (0 for ``policy="full"``); for the entropy bonus.
    selected : Tensor
        Long ``[B, M, S]`` node ids each query read (see :class:`attn_ext.TreeAttentionResult`).
    """

    out: Tensor
    log_prob: Tensor
    entropy: Tensor
    selected: Tensor


class TreeCrossAttention(nn.Module):
    """Multi-head Tree Cross Attention: each query attends over ``O(log N)`` tree nodes of its context.

    ``build(context, coords)`` sorts the tokens by ``coords``, aggregates the context embeddings into
    node embeddings (``"mean"``: masked mean of the children; ``"transformer"``: one pre-norm
    self-attention block over the children, then the masked mean — ReTreever's aggregator, see
    :class:`attn_ext.nn.tree_aggregator.TransformerAggregator`)
    and projects them to per-head keys/values. ``forward(query, state)`` projects the queries,
    descends the tree (the policy is the head-averaged attention of the query over the children;
    sampled in training, argmax in evaluation), attends over the selected nodes, merges the heads
    and applies ``out_proj``. ``forward_full`` attends over all leaves with the same weights.

    Parameters
    ----------
    dim : int
        Width of queries and context embeddings.
    num_heads : int
        Number of heads; must divide ``dim``.
    branching : int
        ``b >= 2`` children per tree node.
    aggregator : {"mean", "transformer"}
        How node embeddings are formed from their children.
    ff_dim : int, optional
        Feed-forward width of the ``"transformer"`` aggregator (default ``2 * dim``).
    backprop_through_tree : bool
        False detaches the children at every level of the aggregation (the official ReTreever's
        ``bptt=False``): internal nodes then train only the aggregator, not the context's producer.
    bias : bool
        Biases of the projections.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.nn.tree_cross_attention import TreeCrossAttention   # also ae.nn.TreeCrossAttention
    >>> _ = torch.manual_seed(0)
    >>> tca = TreeCrossAttention(dim=16, num_heads=2).eval()
    >>> context, coords = torch.randn(3, 128, 16), torch.rand(3, 128, 1)
    >>> state = tca.build(context, coords)
    >>> res = tca(torch.randn(3, 5, 16), state)                  # greedy in eval mode
    >>> res.out.shape, res.log_prob.shape, res.selected.shape    # 8 of 128 tokens read
    (torch.Size([3, 5, 16]), torch.Size([3, 5]), torch.Size([3, 5, 8]))
    >>> tca.forward_full(torch.randn(3, 5, 16), state).shape
    torch.Size([3, 5, 16])
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        branching: int = 2,
        aggregator: str = "mean",
        *,
        ff_dim: Optional[int] = None,
        backprop_through_tree: bool = True,
        bias: bool = True,
    ) -> None:
        for name, value in (("dim", dim), ("num_heads", num_heads)):
            if not is_int_scalar(value) or value <= 0:
                raise ValueError(f"attn_ext.nn.TreeCrossAttention: {name} must be a positive int, got {value!r}")
        if dim % num_heads:
            raise ValueError(f"attn_ext.nn.TreeCrossAttention: dim={dim} must be divisible by num_heads={num_heads}")
        if not is_int_scalar(branching) or branching < 2:
            raise ValueError(f"attn_ext.nn.TreeCrossAttention: branching must be an int >= 2, got {branching!r}")
        dim, num_heads, branching = int(dim), int(num_heads), int(branching)
        if aggregator not in AGGREGATORS:
            raise ValueError(
                f"attn_ext.nn.TreeCrossAttention: unknown aggregator {aggregator!r}; choose one of {', '.join(AGGREGATORS)}"
            )
        super().__init__()
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.branching, self.aggregator = branching, aggregator
        self.q_proj = nn.Linear(dim, dim, bias=bias)
        self.k_proj = nn.Linear(dim, dim, bias=bias)
        self.v_proj = nn.Linear(dim, dim, bias=bias)
        self.out_proj = nn.Linear(dim, dim, bias=bias)
        self.backprop_through_tree = backprop_through_tree
        self.aggregate = TransformerAggregator(dim, num_heads, ff_dim or 2 * dim) if aggregator == "transformer" else None

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, branching={self.branching}, "
                f"aggregator={self.aggregator!r}, backprop_through_tree={self.backprop_through_tree}")

    def _split_heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def _check_input(self, x: Tensor, name: str) -> None:
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.dim:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"attn_ext.nn.TreeCrossAttention: {name} must be [B, L, {self.dim}], got {got}")

    def build(self, context: Tensor, coords: Tensor, key_padding_mask: Optional[Tensor] = None) -> TreeState:
        """Tree, node embeddings and per-head node keys/values of a context (once per context).

        Parameters
        ----------
        context : Tensor
            ``[B, N, dim]`` context embeddings (e.g. an encoder's output).
        coords : Tensor
            ``[B, N, C]`` coordinates or a ``[B, N]`` sort key of the tokens (see :func:`attn_ext.build_tree`).
        key_padding_mask : Tensor, optional
            Bool ``[B, N]``, True = padding token.

        Returns
        -------
        TreeState
        """
        self._check_input(context, "context")
        if not isinstance(coords, Tensor) or tuple(coords.shape[:2]) != tuple(context.shape[:2]):
            got = tuple(coords.shape) if isinstance(coords, Tensor) else type(coords).__name__
            raise ValueError(
                f"attn_ext.nn.TreeCrossAttention: coords must be [B, N, C] or [B, N] with [B, N] = "
                f"{list(context.shape[:2])} of the context, got {got}"
            )
        tree = _tree.build_tree(coords, branching=self.branching, key_padding_mask=key_padding_mask)
        reduce = make_reducer(self.aggregate if self.aggregate is not None else "mean", self.backprop_through_tree)
        nodes = _tree.tree_aggregate(tree, context, reduce=reduce)
        return TreeState(tree, nodes, self._split_heads(self.k_proj(nodes)), self._split_heads(self.v_proj(nodes)))

    def forward(
        self,
        query: Tensor,
        tree_state: TreeState,
        policy: Optional[str] = None,
        generator: Optional[torch.Generator] = None,
    ) -> TreeCrossAttentionOutput:
        """Tree cross attention of ``query [B, M, dim]`` over the context of ``tree_state``.

        ``policy`` is ``"sample"`` in training mode and ``"greedy"`` in evaluation mode unless given
        (``"greedy"``, ``"sample"`` or ``"full"``); ``generator`` makes the draws reproducible.
        """
        if policy is None:
            policy = "sample" if self.training else "greedy"
        self._check_input(query, "query")
        if not isinstance(tree_state, TreeState):
            raise TypeError(
                f"attn_ext.nn.TreeCrossAttention: tree_state must come from build(), got {type(tree_state).__name__}"
            )
        q = self._split_heads(self.q_proj(query))
        res = _tree.tree_cross_attention(
            q, tree_state.node_k, tree_state.node_v, tree_state.tree, policy=policy, generator=generator
        )
        out = self.out_proj(res.out.transpose(1, 2).flatten(2))
        return TreeCrossAttentionOutput(out, res.log_prob, res.entropy, res.selected)

    def forward_full(self, query: Tensor, tree_state: TreeState) -> Tensor:
        """``[B, M, dim]``: attention over all valid leaves with the same weights (the ``L_CA`` term)."""
        return self.forward(query, tree_state, policy="full").out
