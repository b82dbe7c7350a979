"""Tree Cross Attention (docs/spec.md §3): build a tree over the tokens, aggregate node values, retrieve + attend.

:mod:`.build` (the tree), :mod:`.aggregate` (``tree_aggregate``), :mod:`.retrieval`
(``tree_cross_attention``); the readable PyTorch reference is :mod:`.naive`; :mod:`.registration`
binds every backend as a custom op.

>>> import torch, attn_ext as ae
>>> tree = ae.build_tree(torch.rand(1, 256, 2), branching=2)
>>> tree.num_selected == ae.tree_num_selected(256, 2) == 9
True
"""
from attn_ext.ops.tree import registration  # noqa: F401  (custom ops, fakes, autograd, backends)
from attn_ext.ops.tree.aggregate import tree_aggregate
from attn_ext.ops.tree.build import Tree, build_tree, tree_height_and_group_size, tree_num_selected
from attn_ext.ops.tree.naive import TreeAttentionResult, masked_mean
from attn_ext.ops.tree.retrieval import POLICIES, tree_cross_attention

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
