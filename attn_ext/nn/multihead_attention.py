"""``MultiheadCrossAttention``: a drop-in for ``torch.nn.MultiheadAttention`` on the fused kernel.

Same constructor, parameter names, shapes and initialisation as ``torch.nn.MultiheadAttention``, so
``load_state_dict`` works both ways; the attention itself runs on :func:`attn_ext.cross_attention`,
which never forms the ``[L, S]`` score matrix. That is also why the options that need the matrix
(returning the weights, dropout on them, arbitrary additive masks) raise instead of running.
"""
from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

import attn_ext.ops.cross_attention.state as st
from attn_ext.ops.cross_attention.state import AttentionState

_NO_MATRIX = "the fused kernel never forms the [L, S] attention matrix"


class MultiheadCrossAttention(nn.Module):
    """Multi-head attention computed by :func:`attn_ext.cross_attention`, with an incremental path.

    A drop-in for ``torch.nn.MultiheadAttention``: identical constructor arguments (in the same
    order), parameters (``in_proj_weight`` or ``q/k/v_proj_weight``, ``in_proj_bias``, ``out_proj``)
    and initialisation, so a checkpoint of one loads into the other. ``forward`` returns
    ``(out, None)``: the attention weights are never formed.

    Differences from ``torch.nn.MultiheadAttention``:

    * ``batch_first`` defaults to ``True`` (pass ``batch_first=False`` for the ``[L, B, E]`` layout);
    * ``need_weights`` defaults to ``False``; ``need_weights=True``, ``attn_mask``, ``is_causal``,
      ``add_bias_kv``, ``add_zero_attn`` and attention dropout in training mode raise
      ``NotImplementedError`` (``dropout > 0`` is accepted so that configurations load, and
      evaluation mode runs);
    * ``key_padding_mask`` must be bool (True = ignore); float masks raise ``TypeError``;
    * a query whose keys are all padding gets the output of a zero attention vector
      (``out_proj.bias``) instead of NaN;
    * shape errors raise ``ValueError`` (torch raises ``AssertionError``).

    As in torch, ``forward`` also takes unbatched inputs, ``query [L, E]``, ``key [S, kdim]``,
    ``value [S, vdim]`` with ``key_padding_mask [S]``, and returns ``[L, E]``.

    The incremental path keeps the per-head attention state *before* ``out_proj``:
    :meth:`state`, :meth:`update`, :meth:`remove` and :meth:`query`, with
    ``forward(q, k, v)[0] == query(state(q, k, v))``; it takes batched inputs only.

    Parameters
    ----------
    embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first, device, dtype
        As in ``torch.nn.MultiheadAttention``.
    chunk_size : int, optional
        Keyword only: keys per chunk of the fused kernel (see :func:`attn_ext.cross_attention`).
    backend : str, optional
        Keyword only: kernel backend (``"cpp"``, ``"triton"``, ``"reference"``; default automatic).

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> torch_mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    >>> mha = ae.nn.MultiheadCrossAttention(32, 4)
    >>> _ = mha.load_state_dict(torch_mha.state_dict())
    >>> q, kv = torch.randn(2, 5, 32), torch.randn(2, 100, 32)
    >>> out, weights = mha(q, kv, kv)
    >>> expected, _ = torch_mha(q, kv, kv, need_weights=False)
    >>> bool(torch.allclose(out, expected, atol=1e-5)), weights
    (True, None)
    >>> state = mha.state(q, kv[:, :60], kv[:, :60])
    >>> state = mha.update(state, q, kv[:, 60:], kv[:, 60:])
    >>> bool(torch.allclose(mha.query(state), out, atol=1e-5))
    True
    """

    __constants__ = ["batch_first"]

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        batch_first: bool = True,
        device=None,
        dtype=None,
        *,
        chunk_size: Optional[int] = None,
        backend: Optional[str] = None,
    ) -> None:
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be positive, got embed_dim={embed_dim}, num_heads={num_heads}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        if add_bias_kv or add_zero_attn:
            raise NotImplementedError(
                "attn_ext.nn.MultiheadCrossAttention does not support add_bias_kv or add_zero_attn: they append "
                "extra keys that would have to be carried through every incremental update; use "
                "torch.nn.MultiheadAttention for them"
            )
        if not 0.0 <= dropout <= 1.0:
            raise ValueError(f"dropout must be in [0, 1], got {dropout}")
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        # The attribute name is torch's: code that inspects an nn.MultiheadAttention reads it.
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        self.chunk_size = chunk_size
        self.backend = backend

        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty((3 * embed_dim, embed_dim), **factory_kwargs))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty((embed_dim, embed_dim), **factory_kwargs))
            self.k_proj_weight = nn.Parameter(torch.empty((embed_dim, self.kdim), **factory_kwargs))
            self.v_proj_weight = nn.Parameter(torch.empty((embed_dim, self.vdim), **factory_kwargs))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory_kwargs))
        else:
            self.register_parameter("in_proj_bias", None)
        # Created before the in-projection is initialised, as in torch, so that the same seed gives
        # the same parameters as torch.nn.MultiheadAttention.
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **factory_kwargs)
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, kdim={self.kdim}, vdim={self.vdim}, "
                f"dropout={self.dropout}, batch_first={self.batch_first}")

    # ------------------------------------------------------------------------------------------
    # Projections between the module layout [B, L, E] and the kernel layout [B, H, L, E/H]
    # ------------------------------------------------------------------------------------------

    def _projection_weights(self) -> Tuple[Tuple[Tensor, Tensor, Tensor], Tuple[Optional[Tensor], ...]]:
        if self._qkv_same_embed_dim:
            weights = tuple(self.in_proj_weight.chunk(3))
        else:
            weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        biases = (None, None, None) if self.in_proj_bias is None else tuple(self.in_proj_bias.chunk(3))
        return weights, biases

    def _to_batch_first(self, x: Tensor, name: str, width: int) -> Tensor:
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != width:
            seq = "L" if name == "query" else "S"
            layout = f"[B, {seq}, {width}]" if self.batch_first else f"[{seq}, B, {width}]"
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"attn_ext.nn: {name} must be {layout} (batch_first={self.batch_first}) or, in forward, "
                             f"unbatched [{seq}, {width}]; got {shape}")
        return x if self.batch_first else x.transpose(0, 1)

    def _split_heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def _heads_q(self, query: Tensor) -> Tensor:
        """Projected queries ``[B, H, L, E/H]`` of ``query`` in the module layout."""
        (w_q, _, _), (b_q, _, _) = self._projection_weights()
        return self._split_heads(F.linear(self._to_batch_first(query, "query", self.embed_dim), w_q, b_q))

    def _heads_kv(self, key: Tensor, value: Tensor) -> Tuple[Tensor, Tensor]:
        """Projected keys and values ``[B, H, S, E/H]`` of ``key, value`` in the module layout."""
        (_, w_k, w_v), (_, b_k, b_v) = self._projection_weights()
        key = self._to_batch_first(key, "key", self.kdim)
        value = self._to_batch_first(value, "value", self.vdim)
        if key.shape[:2] != value.shape[:2]:
            raise ValueError(f"attn_ext.nn: key {tuple(key.shape)} and value {tuple(value.shape)} must have the same "
                             "batch and sequence sizes (batch_first layout)")
        return self._split_heads(F.linear(key, w_k, b_k)), self._split_heads(F.linear(value, w_v, b_v))

    def _merge_heads(self, out: Tensor) -> Tensor:
        merged = self.out_proj(out.transpose(1, 2).flatten(2))
        return merged if self.batch_first else merged.transpose(0, 1)

    def _check_runnable(self, key_padding_mask: Optional[Tensor]) -> None:
        if self.training and self.dropout > 0.0:
            raise NotImplementedError(
                f"attn_ext.nn.MultiheadCrossAttention: dropout={self.dropout} on the attention weights is not "
                f"supported in training mode, because {_NO_MATRIX}; use dropout=0.0 or call .eval()"
            )
        if key_padding_mask is not None and isinstance(key_padding_mask, Tensor) and key_padding_mask.dtype != torch.bool:
            raise TypeError(
                f"attn_ext.nn: key_padding_mask must be a bool tensor (True = ignore that key), got "
                f"{key_padding_mask.dtype}; float (additive) masks are not supported — for a 0/-inf mask pass "
                "`mask == float('-inf')`"
            )

    # ------------------------------------------------------------------------------------------
    # torch.nn.MultiheadAttention interface
    # ------------------------------------------------------------------------------------------

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = False,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> Tuple[Tensor, None]:
        """Attention of ``query`` over ``key, value``; returns ``(out, None)``.

        ``query [B, L, E]``, ``key [B, S, kdim]``, ``value [B, S, vdim]`` (``[L, B, ·]`` if not
        ``batch_first``); ``key_padding_mask`` bool ``[B, S]``, True = ignore. Unbatched inputs
        ``[L, E]``, ``[S, kdim]``, ``[S, vdim]`` with a ``[S]`` mask give an unbatched ``[L, E]``
        output, as in torch. ``average_attn_weights`` is accepted for signature compatibility and
        has no effect (there are no weights).
        """
        if need_weights:
            raise NotImplementedError(
                "attn_ext.nn.MultiheadCrossAttention cannot return attention weights (need_weights=True): "
                f"{_NO_MATRIX}. Call it with need_weights=False (torch.nn.MultiheadAttention defaults to True)"
            )
        if attn_mask is not None or is_causal:
            raise NotImplementedError(
                "attn_ext.nn.MultiheadCrossAttention supports no attn_mask or is_causal: the fused cross-attention "
                "kernel takes only a per-key padding mask (key_padding_mask, bool [B, S], True = ignore), as "
                f"{_NO_MATRIX}"
            )
        if isinstance(query, Tensor) and query.dim() == 2:  # unbatched: a batch of one, as torch does it
            query, key, value, key_padding_mask = self._batch_of_one(query, key, value, key_padding_mask)
            out = self.query(self.state(query, key, value, key_padding_mask))
            return out.squeeze(0 if self.batch_first else 1), None
        return self.query(self.state(query, key, value, key_padding_mask)), None

    def _batch_of_one(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor]):
        """Unbatched ``[L, E]``, ``[S, kdim]``, ``[S, vdim]``, mask ``[S]`` as a batch of one in the module layout."""
        if not (isinstance(key, Tensor) and isinstance(value, Tensor) and key.dim() == 2 and value.dim() == 2):
            shapes = [tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in (key, value)]
            raise ValueError(f"attn_ext.nn: for an unbatched (2-D) query [L, E], key and value must be 2-D [S, kdim] "
                             f"and [S, vdim]; got key {shapes[0]} and value {shapes[1]}")
        for name, t, width in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            if t.shape[-1] != width:
                seq = "L" if name == "query" else "S"
                raise ValueError(f"attn_ext.nn: unbatched {name} must be [{seq}, {width}], got {tuple(t.shape)}")
        if isinstance(key_padding_mask, Tensor) and key_padding_mask.dim() != 1:
            raise ValueError(f"attn_ext.nn: for an unbatched (2-D) query, key_padding_mask must be None or 1-D [S], "
                             f"got {tuple(key_padding_mask.shape)}")
        batch_dim = 0 if self.batch_first else 1
        mask = key_padding_mask.unsqueeze(0) if isinstance(key_padding_mask, Tensor) else key_padding_mask
        return query.unsqueeze(batch_dim), key.unsqueeze(batch_dim), value.unsqueeze(batch_dim), mask

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
