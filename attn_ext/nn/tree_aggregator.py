"""Node aggregators of :class:`attn_ext.nn.TreeCrossAttention`: how a tree node's embedding is formed
from its children's (the ``reduce`` of :func:`attn_ext.tree_aggregate`)."""
from __future__ import annotations

from typing import Callable, Union

from torch import Tensor, nn

from attn_ext.nn.prenorm_block import PreNormBlock
from attn_ext.ops.tree import masked_mean

AGGREGATORS = ("mean", "transformer")
Reducer = Callable[[Tensor, Tensor], Tensor]


class TransformerAggregator(nn.Module):
    """ReTreever's aggregator: a pre-norm self-attention block over the children, then their masked mean.

    The attention runs on attn_ext's :class:`~attn_ext.nn.MultiheadCrossAttention` (through
    :class:`~attn_ext.nn.PreNormBlock`), with the padding children masked out as keys.

    Parameters
    ----------
    dim, num_heads, ff_dim : int
        Width, heads and feed-forward width of the block.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.nn.tree_aggregator import TransformerAggregator
    >>> aggregate = TransformerAggregator(dim=16, num_heads=2, ff_dim=32)
    >>> children = torch.randn(3, 5, 2, 16)                   # [B, nodes, children, dim]
    >>> padding = torch.tensor([False, True]).expand(3, 5, 2)  # the second child of every node is padding
    >>> aggregate(children, padding).shape
    torch.Size([3, 5, 16])
    """

    def __init__(self, dim: int, num_heads: int, ff_dim: int) -> None:
        super().__init__()
        self.block = PreNormBlock(dim, num_heads, ff_dim, cross=False)

    def forward(self, children: Tensor, padding_mask: Tensor) -> Tensor:
        B, n, c, E = children.shape
        flat_mask = padding_mask.reshape(B * n, c)
        # A node whose children are all padding would attend over nothing; unmasking its row is
        # harmless because the masked mean below ignores it anyway.
        flat_mask = flat_mask & ~flat_mask.all(dim=-1, keepdim=True)
        mixed = self.block(children.reshape(B * n, c, E), context_mask=flat_mask)
        return masked_mean(mixed.view(B, n, c, E), padding_mask)


def make_reducer(aggregate: Union[str, nn.Module], backprop_through_tree: bool) -> Union[str, Reducer]:
    """The ``reduce`` argument of :func:`attn_ext.tree_aggregate` for an aggregator.

    With ``backprop_through_tree=False`` every level's children are detached (the official
    ReTreever's ``bptt=False``): the internal nodes still train the aggregator's own weights, but send
    no gradient down into the leaves, so the encoder learns from the leaves' attention alone.
    """
    if backprop_through_tree:
        return aggregate
    reduce = masked_mean if aggregate == "mean" else aggregate
    return lambda children, padding_mask: reduce(children.detach(), padding_mask)
