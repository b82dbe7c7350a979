"""Softmax attention, exact and chunked over the keys with a running max / log-sum-exp state (docs/spec.md §1).

One family from the general op to its special cases and the states built on them:

* :func:`scaled_dot_product_attention` (:mod:`.scaled_dot_product`): ``torch.nn.functional``'s semantics
  (attention masks, causal order, dropout, grouped key/value heads) on op ``attention_fwd``;
* :func:`cross_attention` (:mod:`.chunked`): key padding as the only rule, op ``cross_attention_fwd``;
* :func:`varlen_attention` (:mod:`.varlen`): a packed batch of sequences of different lengths, per sequence;
* :func:`paged_attention` (:mod:`.paged`): new tokens over a paged key/value cache (a block table);
* the attention-state API (:mod:`.state`: update, merge, remove, stream; :mod:`.sliding_window_state`: the last
  ``W`` keys of a stream) and its sharding over ``torch.distributed`` (:mod:`.sharded`).

The readable PyTorch reference is :mod:`.naive` (with the pair rules of :mod:`.pairs` and the dropout of
:mod:`.dropout`); :mod:`.registration` binds every backend as a custom op and opens with the table from
public function to kernel; the Triton kernels are the ``triton_*`` modules.
"""
from attn_ext.ops.attention import registration  # noqa: F401  (custom ops, fakes, autograd, backends)
from attn_ext.ops.attention.chunked import DEFAULT_CHUNK_SIZE, cross_attention
from attn_ext.ops.attention.paged import paged_attention
from attn_ext.ops.attention.scaled_dot_product import scaled_dot_product_attention
from attn_ext.ops.attention.sliding_window_state import SlidingWindowState
from attn_ext.ops.attention.state import (
    AttentionState,
    attention_state,
    empty_state,
    merge_states,
    remove_from_state,
    stream_attention,
    update_state,
)
from attn_ext.ops.attention.varlen import varlen_attention

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "AttentionState",
    "SlidingWindowState",
    "attention_state",
    "cross_attention",
    "empty_state",
    "merge_states",
    "paged_attention",
    "remove_from_state",
    "scaled_dot_product_attention",
    "stream_attention",
    "update_state",
    "varlen_attention",
]
