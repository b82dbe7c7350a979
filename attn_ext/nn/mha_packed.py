"""The packed path of :class:`attn_ext.nn.MultiheadAttention`: a batch of sequences of different lengths laid end
to end (FlashAttention's varlen layout) instead of padded to the longest, attended by
:func:`attn_ext.varlen_attention`, so that no padding is formed and each sequence costs what its own lengths
cost.

A mixin of the module, which provides the projections (``_projection_weights``), ``out_proj``, ``dropout`` and
the ``chunk_size`` and ``backend`` of its kernels.
"""
from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor

from attn_ext.nn import mha_inputs
from attn_ext.ops.attention.varlen import varlen_attention


class PackedPath:
    """:meth:`packed`: ``forward`` over a packed batch."""

    def packed(self, query: Tensor, key: Tensor, value: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
               max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None, *, is_causal: bool = False,
               window_size: Optional[Tuple[int, int]] = None, alignment: str = "top_left") -> Tensor:
        """Attention of each packed sequence's queries over its own keys, projected as ``forward`` projects.

        ``query [total_q, embed_dim]``, ``key [total_k, kdim]``, ``value [total_k, vdim]``: sequence ``b`` holds
        rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of ``query`` and ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of
        ``key`` and ``value`` (int32 ``[B + 1]``, from 0, non-decreasing; ``max_seqlen_*`` optional hints, checked
        when given). Returns ``[total_q, embed_dim]``, row for row what ``forward(...,
        need_weights=False)`` gives for the same sequence alone (attention dropout in training mode as the
        fused op draws it). ``is_causal``, ``window_size`` and ``alignment`` as for
        :func:`attn_ext.varlen_attention`, per sequence. No ``attn_mask`` or ``key_padding_mask``: a packed batch
        has no padding, and a per-pair mask has no packed layout. ``add_bias_kv`` and ``add_zero_attn`` are
        refused (their extra keys would belong to every sequence).
        """
        name = f"attn_ext.nn.{type(self).__name__}.packed"
        if mha_inputs.extra_keys(self):
            raise NotImplementedError(f"{name}: add_bias_kv and add_zero_attn are not supported on a packed batch "
                                      "(each sequence would need its own extra keys); use forward on a padded batch")
        widths = {"query": self.embed_dim, "key": self.kdim, "value": self.vdim}
        for arg, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, Tensor) or t.dim() != 2 or t.shape[1] != widths[arg]:
                shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(f"{name}: {arg} must be [total, {widths[arg]}] (sequences packed along dim 0), "
                                 f"got {shape}")
        if key.shape[0] != value.shape[0]:
            raise ValueError(f"{name}: key {tuple(key.shape)} and value {tuple(value.shape)} must have the same "
                             "number of rows")
        (w_q, w_k, w_v), (b_q, b_k, b_v) = self._projection_weights()
        heads = (self.num_heads, self.head_dim)
        q = mha_inputs.project(query, w_q, b_q).unflatten(-1, heads)
        k = mha_inputs.project(key, w_k, b_k).unflatten(-1, heads)
        v = mha_inputs.project(value, w_v, b_v).unflatten(-1, heads)
        out = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=self.dropout if self.training else 0.0, is_causal=is_causal,
                               window_size=window_size, alignment=alignment, chunk_size=self.chunk_size,
                               backend=self.backend)
        return self.out_proj(out.flatten(1))
