"""Chunked cross attention with a running max / log-sum-exp state (docs/spec.md §1).

``cross_attention`` (:mod:`.chunked`), the attention-state API built on it (:mod:`.state`: update,
merge, remove, stream) and its sharding over ``torch.distributed`` (:mod:`.sharded`). The readable
PyTorch reference is :mod:`.naive`; :mod:`.registration` binds every backend as a custom op.
"""
from attn_ext.ops.cross_attention import registration  # noqa: F401  (custom ops, fakes, autograd, backends)
from attn_ext.ops.cross_attention.chunked import DEFAULT_CHUNK_SIZE, cross_attention
from attn_ext.ops.cross_attention.state import (
    AttentionState,
    attention_state,
    empty_state,
    merge_states,
    remove_from_state,
    stream_attention,
    update_state,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "AttentionState",
    "attention_state",
    "cross_attention",
    "empty_state",
    "merge_states",
    "remove_from_state",
    "stream_attention",
    "update_state",
]
