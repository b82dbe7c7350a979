"""Tree Cross Attention (SPEC §3): build a tree over the tokens, aggregate node values, retrieve + attend.

This package holds the pure-PyTorch reference (readable, vectorised over batch, heads and queries) and
the registration of the fused C++ kernel (``backend="cpp"``, the default on CPU).

>>> import torch
>>> from attn_ext.tree import build_tree, tree_aggregate, tree_cross_attention, tree_num_selected
>>> tree = build_tree(torch.rand(1, 256, 2), branching=2)
>>> tree.num_selected == tree_num_selected(256, 2) == 9
True
"""
from attn_ext.tree.aggregate import masked_mean, tree_aggregate
from attn_ext.tree.build import Tree, build_tree, tree_height_and_group_size, tree_num_selected
from attn_ext.tree.retrieval import POLICIES, TreeAttentionResult, tree_cross_attention
from attn_ext.tree import aggregate_ops, ops  # noqa: F401,E402  (fake kernels and autograd of the fused ops)

__all__ = [
    "POLICIES",
    "Tree",
    "TreeAttentionResult",
    "build_tree",
    "masked_mean",
    "tree_aggregate",
    "tree_cross_attention",
    "tree_height_and_group_size",
    "tree_num_selected",
]
