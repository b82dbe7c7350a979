"""``paged_attention_fwd`` on the Triton kernels: the new tokens of each batch entry attend its cached keys read in
place through the block table (the forward kernel's ``PAGED`` path, :mod:`.triton_fwd_blocks`), never gathered.

The call runs as a packed batch (:mod:`.triton_varlen`) whose sequence ``b`` holds entry ``b``'s ``M`` queries
(copied into the packed rows: a decoding step's few tokens) and its ``cache_seqlens[b]`` keys, aligned at their end;
the kernel reads key ``n`` of entry ``b`` from row ``n % block_size`` of block ``block_table[b, n // block_size]``.
A decoding step over long caches splits its keys over programs like any other (:mod:`.triton_split_keys`).
"""
from __future__ import annotations

from itertools import accumulate
from typing import Optional, Tuple

import torch
from torch import Tensor

from attn_ext.ops.attention.triton_fwd import launch_forward
from attn_ext.ops.attention.triton_varlen import Packed, PagedKeys, packed_scores

__all__ = ["paged_forward"]


def paged_forward(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, lengths: list, scale: float,
                  is_causal: bool, window_left: int, window_right: int, softcap: float,
                  alibi_slopes: Optional[Tensor], chunk_size: int, key_parts: Optional[int] = None
                  ) -> Tuple[Tensor, Tensor]:
    """``(out [B, H, M, Dv], lse [B, H, M])`` of checked arguments (``lengths``: the host copy of ``cache_seqlens``;
    ``alibi_slopes`` float32 ``[B, H]`` or None); ``key_parts`` forces the split over keys (tests)."""
    B, H, M, D = q.shape
    block_size, Hkv = k_cache.shape[1:3]
    Dv = v_cache.shape[-1]
    if B * H * M == 0:
        return q.new_zeros(B, H, M, Dv), q.new_full((B, H, M), float("-inf"), dtype=torch.float32)
    key_offsets = list(accumulate(lengths, initial=0))  # on the host: the segments need them there
    segments = [(b * M, (b + 1) * M, key_offsets[b], key_offsets[b + 1]) for b in range(B)]
    cu_q = torch.arange(B + 1, dtype=torch.int32, device=q.device) * M
    cu_k = torch.tensor(key_offsets, dtype=torch.int32, device=q.device)
    packed = Packed(cu_q, cu_k, segments, M, max(lengths, default=0), True)
    # The packed rows of the queries: entry after entry, as [1, H, B·M, D].
    rows = q.transpose(1, 2).reshape(B * M, H, D).transpose(0, 1)[None]
    # K and V as the kernel reads them: its head, row and feature strides those of the cache, its rows within a block
    # (the block stride and the table come in PagedKeys); one block's worth of rows, a view that stays in bounds.
    k, v = (cache.as_strided((1, Hkv, block_size, cache.shape[-1]),
                             (0, cache.stride(2), cache.stride(1), cache.stride(3)), cache.storage_offset())
            for cache in (k_cache, v_cache))
    table = block_table.to(device=q.device, dtype=torch.int32)
    paged = PagedKeys(table, table.stride(0), block_size, k_cache.stride(0), v_cache.stride(0))
    scores = packed_scores(packed, is_causal, window_left, window_right, softcap, alibi_slopes, q)
    out, lse = launch_forward(rows, k, v, None, scale, chunk_size, is_causal=is_causal and not scores.window,
                              scores=scores, packed=packed, key_parts=key_parts, paged=paged)
    return (out[0].reshape(H, B, M, Dv).transpose(0, 1).contiguous(),
            lse[0].reshape(H, B, M).transpose(0, 1).contiguous())
