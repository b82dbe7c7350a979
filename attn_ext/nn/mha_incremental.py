"""The incremental path of :class:`attn_ext.nn.MultiheadAttention`: the per-head attention state before
``out_proj``, grown, shrunk and streamed over keys (``state``, ``empty_state``, ``update``, ``remove``,
``stream``, ``query``), on :mod:`attn_ext.ops.attention.state`.

A mixin of the module, which provides the projections (``_heads_q``, ``_heads_kv``, ``_merge_heads``) and the
``chunk_size`` and ``backend`` of its kernels.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import Tensor

import attn_ext.ops.attention.state as st
from attn_ext.nn import mha_inputs
from attn_ext.ops.attention import AttentionState


class IncrementalPath:
    """``forward(q, k, v)[0] == query(state(q, k, v))`` for a bool ``key_padding_mask`` and no ``attn_mask``;
    batched inputs only; dropout in training, ``add_bias_kv`` and ``add_zero_attn`` refused by name."""

    def _check_runnable(self, key_padding_mask: Optional[Tensor]) -> None:
        """What the incremental path cannot do (the state of a set of keys must not depend on the call)."""
        if self.training and self.dropout > 0.0:
            raise NotImplementedError(
                f"attn_ext.nn: the incremental path (state/update/remove/stream) has no attention dropout; "
                f"dropout={self.dropout} in training mode: use forward, dropout=0.0 or call .eval()")
        if mha_inputs.extra_keys(self):
            raise NotImplementedError(
                "attn_ext.nn: the incremental path (state/update/remove/stream) does not support add_bias_kv or "
                "add_zero_attn (their extra keys would be counted again at every update); use forward")
        if isinstance(key_padding_mask, Tensor) and key_padding_mask.dtype != torch.bool:
            raise TypeError(
                f"attn_ext.nn: the incremental path takes a bool key_padding_mask (True = ignore that key), got "
                f"{key_padding_mask.dtype}; for a 0/-inf mask pass `mask == float('-inf')`, or use forward")

    # ------------------------------------------------------------------------------------------
    # Incremental path (per-head state before out_proj)
    # ------------------------------------------------------------------------------------------

    def state(self, query: Tensor, key: Tensor, value: Tensor,
              key_padding_mask: Optional[Tensor] = None) -> AttentionState:
        """Per-head :class:`attn_ext.AttentionState` ``(out [B, H, L, E/H], lse [B, H, L])`` of the
        projected ``query`` over ``key, value``, before ``out_proj``; :meth:`query` finishes it."""
        self._check_runnable(key_padding_mask)
        q = self._heads_q(query)
        k, v = self._heads_kv(key, value)
        return st.attention_state(q, k, v, key_padding_mask=key_padding_mask,
                                  chunk_size=self.chunk_size, backend=self.backend)

    def empty_state(self, query: Tensor) -> AttentionState:
        """The state of ``query`` over no keys, to be grown by :meth:`update`."""
        return st.empty_state(self._heads_q(query), self.head_dim)

    def update(self, state: AttentionState, query: Tensor, key_new: Tensor, value_new: Tensor,
               key_padding_mask: Optional[Tensor] = None) -> AttentionState:
        """Add keys to ``state`` (which must be of the same ``query``) in O(new keys)."""
        self._check_runnable(key_padding_mask)
        q = self._heads_q(query)
        k, v = self._heads_kv(key_new, value_new)
        return st.update_state(state, q, k, v, key_padding_mask=key_padding_mask,
                               chunk_size=self.chunk_size, backend=self.backend)

    def remove(self, state: AttentionState, query: Tensor, key_old: Tensor, value_old: Tensor,
               key_padding_mask: Optional[Tensor] = None, *,
               min_remaining: float = st.DEFAULT_MIN_REMAINING) -> AttentionState:
        """Remove keys previously added to ``state``; raises ``ValueError`` where less than
        ``min_remaining`` of the softmax mass would remain (see :func:`attn_ext.remove_from_state`)."""
        self._check_runnable(key_padding_mask)
        q = self._heads_q(query)
        k, v = self._heads_kv(key_old, value_old)
        return st.remove_from_state(state, q, k, v, key_padding_mask=key_padding_mask,
                                    min_remaining=min_remaining, chunk_size=self.chunk_size, backend=self.backend)

    def stream(self, query: Tensor, chunks: Iterable) -> AttentionState:
        """State of ``query`` over key chunks from an iterator (``(key, value)`` or ``(key, value,
        key_padding_mask)`` in the module layout), projecting one chunk at a time."""
        q = self._heads_q(query)

        def projected():
            for chunk in chunks:
                mask = chunk[2] if len(chunk) == 3 else None
                self._check_runnable(mask)
                yield (*self._heads_kv(chunk[0], chunk[1]), mask)

        return st.stream_attention(q, projected(), chunk_size=self.chunk_size, backend=self.backend)

    def query(self, state: AttentionState) -> Tensor:
        """Output ``[B, L, E]`` (``[L, B, E]`` if not ``batch_first``) of a per-head state: merge
        the heads and apply ``out_proj``."""
        out = state[0]
        if out.dim() != 4 or out.shape[1] != self.num_heads or out.shape[3] != self.head_dim:
            raise ValueError(f"attn_ext.nn: state.out must be [B, {self.num_heads}, L, {self.head_dim}], "
                             f"got {tuple(out.shape)}")
        return self._merge_heads(out)
