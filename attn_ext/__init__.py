"""attn_ext: fused, exact, memory-efficient attention kernels for Neural Processes.

Three op families (``attn_ext.ops``): chunked cross attention with its attention states, tree cross
attention, and Intention, with translation-equivariant attention beside them; the drop-in modules of ``attn_ext.nn`` and the reference Neural Processes
of ``attn_ext.models`` are built on them. Every public op is importable from here.

>>> import torch, attn_ext as ae
>>> out = ae.cross_attention(torch.randn(1, 2, 8, 16), torch.randn(1, 2, 100, 16), torch.randn(1, 2, 100, 16))
>>> out.shape
torch.Size([1, 2, 8, 16])
"""
import importlib

from attn_ext import ops  # noqa: F401  (registers the custom ops, fake kernels, autograd and backends)
from attn_ext import nn
from attn_ext.ops.attention import (
    DEFAULT_CHUNK_SIZE,
    AttentionState,
    SlidingWindowState,
    attention_state,
    cross_attention,
    empty_state,
    merge_states,
    paged_attention,
    remove_from_state,
    scaled_dot_product_attention,
    stream_attention,
    update_state,
    varlen_attention,
)
from attn_ext.ops.intention import (
    IntentionState,
    batched_cholesky,
    batched_cholesky_solve,
    batched_spd_solve,
    convex_intention,
    intention,
    intention_from_state,
    intention_map,
    intention_map_from_state,
    intention_state,
    intention_variance_scale,
    kernelised_intention,
    merge_intention_states,
    pinv_intention,
    pinv_intention_from_state,
    remove_from_intention_state,
    sigma_intention,
    update_intention_state,
)
from attn_ext.ops.te_attention import te_attention
from attn_ext.ops.tree import Tree, TreeAttentionResult, build_tree, tree_aggregate, tree_cross_attention, tree_num_selected
from attn_ext.ops.utils.dispatch import BACKENDS, available_backends

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy, so that `python -m attn_ext.distributed` (the torchrun demo) does not find its own
    # module already imported by the package (runpy warns about that on every rank).
    if name == "distributed":
        return importlib.import_module("attn_ext.distributed")
    raise AttributeError(f"module 'attn_ext' has no attribute {name!r}")


__all__ = [
    "BACKENDS",
    "DEFAULT_CHUNK_SIZE",
    "AttentionState",
    "IntentionState",
    "SlidingWindowState",
    "Tree",
    "TreeAttentionResult",
    "attention_state",
    "available_backends",
    "batched_cholesky",
    "batched_cholesky_solve",
    "batched_spd_solve",
    "build_tree",
    "convex_intention",
    "cross_attention",
    "distributed",
    "empty_state",
    "intention",
    "intention_from_state",
    "intention_map",
    "intention_map_from_state",
    "intention_state",
    "intention_variance_scale",
    "kernelised_intention",
    "merge_intention_states",
    "merge_states",
    "nn",
    "ops",
    "paged_attention",
    "pinv_intention",
    "pinv_intention_from_state",
    "remove_from_intention_state",
    "remove_from_state",
    "scaled_dot_product_attention",
    "sigma_intention",
    "stream_attention",
    "te_attention",
    "tree_aggregate",
    "tree_cross_attention",
    "tree_num_selected",
    "update_intention_state",
    "update_state",
    "varlen_attention",
    "__version__",
]
