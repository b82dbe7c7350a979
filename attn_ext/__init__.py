"""attn_ext: fused, exact, memory-efficient attention kernels for Neural Processes.

>>> import torch, attn_ext as ae
>>> out = ae.cross_attention(torch.randn(1, 2, 8, 16), torch.randn(1, 2, 100, 16), torch.randn(1, 2, 100, 16))
>>> out.shape
torch.Size([1, 2, 8, 16])
"""
from attn_ext import ops  # noqa: F401  (registers the custom ops, fake kernels and autograd)
from attn_ext import nn
from attn_ext import ridge  # Intention and σIntention, ridge-regression attention (SPEC §4)
from attn_ext import tree  # Tree Cross Attention (SPEC §3)
from attn_ext.backends import BACKENDS, available_backends
from attn_ext.cross_attention import DEFAULT_CHUNK_SIZE, cross_attention
from attn_ext.tree import (
    Tree,
    TreeAttentionResult,
    build_tree,
    tree_aggregate,
    tree_cross_attention,
    tree_num_selected,
)
from attn_ext.ridge import (
    IntentionState,
    batched_cholesky,
    batched_cholesky_solve,
    batched_spd_solve,
    intention,
    intention_from_state,
    intention_state,
    merge_intention_states,
    remove_from_intention_state,
    sigma_intention,
    update_intention_state,
)
from attn_ext.state import (
    AttentionState,
    attention_state,
    empty_state,
    merge_states,
    remove_from_state,
    stream_attention,
    update_state,
)

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy, so that `python -m attn_ext.distributed` (the torchrun demo) does not find its own
    # module already imported by the package (runpy warns about that on every rank).
    if name == "distributed":
        import importlib

        return importlib.import_module("attn_ext.distributed")
    raise AttributeError(f"module 'attn_ext' has no attribute {name!r}")

__all__ = [
    "BACKENDS",
    "DEFAULT_CHUNK_SIZE",
    "AttentionState",
    "attention_state",
    "available_backends",
    "cross_attention",
    "distributed",
    "empty_state",
    "intention",
    "merge_states",
    "nn",
    "remove_from_state",
    "stream_attention",
    "update_state",
    "Tree",
    "TreeAttentionResult",
    "build_tree",
    "tree",
    "tree_aggregate",
    "tree_cross_attention",
    "tree_num_selected",
    "IntentionState",
    "batched_cholesky",
    "batched_cholesky_solve",
    "batched_spd_solve",
    "intention_from_state",
    "intention_state",
    "merge_intention_states",
    "remove_from_intention_state",
    "sigma_intention",
    "update_intention_state",
    "__version__",
]
