"""``attn_ext.paged_attention``: new tokens attending a paged key/value cache (vLLM's and FlashAttention's block
table layout): ``k_cache [num_blocks, block_size, Hkv, D]``, ``block_table [B, max_blocks]`` naming each batch
entry's blocks in order, ``cache_seqlens [B]`` its number of cached keys, the ``M`` queries the last ``M`` of them.

Without gradients (inference, decoding) one call of op ``paged_attention_fwd`` (:mod:`.paged_ops`): the ``cpp``
kernels read each key and value row through the block table (a chunk within one block is a view, one spanning
blocks is gathered into the chunk's buffer), one work segment per entry over its own keys. When an input requires
a gradient, each entry's live rows are gathered instead (one index select) and :func:`~attn_ext.varlen_attention`
runs on them: the same result, differentiable in every order.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from attn_ext.ops.attention.chunked import DEFAULT_CHUNK_SIZE
from attn_ext.ops.attention.errors import named_after
from attn_ext.ops.attention.paged_ops import PAGED_ATTENTION, attention_by_gather
from attn_ext.ops.attention.scaled_dot_product import alibi_slopes_for, softcap_value, window_sides
from attn_ext.ops.utils import dispatch
from attn_ext.ops.utils.validation import check_scale

__all__ = ["paged_attention"]

_OP = "attn_ext.paged_attention"


def _check(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor) -> list:
    """The checked lengths (a host list) of a paged call."""
    for name, t, dims in (("q", q, 4), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4),
                          ("block_table", block_table, 2), ("cache_seqlens", cache_seqlens, 1)):
        if not isinstance(t, Tensor) or t.dim() != dims:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{_OP}: {name} must be a {dims}-D tensor, got {got}")
    if block_table.dtype != torch.int32 or cache_seqlens.dtype != torch.int32:
        raise TypeError(f"{_OP}: block_table and cache_seqlens must be int32, got {block_table.dtype} and "
                        f"{cache_seqlens.dtype}")
    B = q.shape[0]
    if block_table.shape[0] != B or cache_seqlens.shape[0] != B:
        raise ValueError(f"{_OP}: block_table {tuple(block_table.shape)} and cache_seqlens "
                         f"{tuple(cache_seqlens.shape)} must have q's batch {B} first")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"{_OP}: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must agree in "
                         "[num_blocks, block_size, Hkv]")
    if q.shape[3] != k_cache.shape[3]:
        raise ValueError(f"{_OP}: q {tuple(q.shape)} and k_cache {tuple(k_cache.shape)} must have the same head dim")
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    capacity = block_table.shape[1] * block_size
    lengths = [int(n) for n in cache_seqlens.tolist()]
    for b, n in enumerate(lengths):
        if not 0 <= n <= capacity:
            raise ValueError(f"{_OP}: cache_seqlens[{b}] = {n} is outside [0, {capacity}] (max_blocks "
                             f"{block_table.shape[1]} x block_size {block_size})")
        used = block_table[b, :(n + block_size - 1) // block_size]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
            raise ValueError(f"{_OP}: block_table[{b}] names a block outside [0, {num_blocks}) among its first "
                             f"{used.numel()} (the ones its {n} keys use)")
    return lengths


@named_after("paged_attention")
def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cache_seqlens: Tensor,
    *,
    is_causal: bool = False,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    window_size: Optional[Tuple[int, int]] = None,
    return_lse: bool = False,
    backend: Optional[str] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention of ``M`` new tokens per batch entry over its cached keys, read through a block table.

    Parameters
    ----------
    q : Tensor
        ``[B, H, M, D]``: the new tokens' queries, the last ``M`` positions of each entry's ``cache_seqlens[b]``
        keys (aligned bottom-right: query ``i`` sits at key ``i + cache_seqlens[b] − M``).
    k_cache, v_cache : Tensor
        ``[num_blocks, block_size, Hkv, D]`` and ``[..., Dv]``; ``H`` a multiple of ``Hkv``.
    block_table : Tensor
        int32 ``[B, max_blocks]``: entry ``b``'s key ``n`` is row ``n % block_size`` of block
        ``block_table[b, n // block_size]``; only the blocks its keys use are read.
    cache_seqlens : Tensor
        int32 ``[B]``: the number of keys of each entry (the new tokens' own included).
    is_causal : bool
        The new tokens attend causally among themselves (and every earlier key).
    scale, softcap, alibi_slopes, window_size
        As for :func:`attn_ext.scaled_dot_product_attention` (``alibi_slopes`` ``[H]`` or ``[B, H]``).
    return_lse : bool
        Also return the log-sum-exp ``[B, H, M]``.

    Returns
    -------
    Tensor or (Tensor, Tensor)
        ``[B, H, M, Dv]`` in q's dtype, and the lse if ``return_lse``.

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> k_cache, v_cache = torch.randn(10, 16, 2, 32), torch.randn(10, 16, 2, 32)  # 10 blocks of 16 keys
    >>> block_table = torch.tensor([[3, 7, 1], [0, 9, 2]], dtype=torch.int32)
    >>> cache_seqlens = torch.tensor([40, 17], dtype=torch.int32)
    >>> q = torch.randn(2, 4, 1, 32)  # one new token per entry, 4 query heads over 2 key/value heads
    >>> out = ae.paged_attention(q, k_cache, v_cache, block_table, cache_seqlens)
    >>> keys = k_cache[[3, 7, 1]].reshape(48, 2, 32)[:40].transpose(0, 1)[None]
    >>> values = v_cache[[3, 7, 1]].reshape(48, 2, 32)[:40].transpose(0, 1)[None]
    >>> ref = ae.scaled_dot_product_attention(q[:1], keys, values, enable_gqa=True)
    >>> bool(torch.allclose(out[:1], ref, atol=1e-6))
    True
    """
    lengths = _check(q, k_cache, v_cache, block_table, cache_seqlens)
    B, H, M, D = q.shape
    if not any(isinstance(t, Tensor) and t.requires_grad for t in (q, k_cache, v_cache)):
        # Inference: one call of the kernels reading the cache through the block table.
        name = dispatch.select_backend(PAGED_ATTENTION, backend, q)
        window_left, window_right = window_sides(window_size, "bottom_right", is_causal)
        cap = softcap_value(softcap)
        slopes = None if alibi_slopes is None else alibi_slopes_for(alibi_slopes, q)
        scale_value = check_scale(scale, "paged_attention")
        scale_value = 1.0 / math.sqrt(D) if scale_value is None else scale_value
        if k_cache.shape[2] == 0 or H % k_cache.shape[2]:
            raise ValueError(f"{_OP}: q has {H} heads and the cache {k_cache.shape[2]}; the query heads must be a "
                             "multiple of them")
        out, lse = dispatch.entry(PAGED_ATTENTION, name)(q, k_cache, v_cache, block_table, cache_seqlens, scale_value,
                                                         is_causal, window_left, window_right, cap, slopes,
                                                         DEFAULT_CHUNK_SIZE)
        return (out, lse) if return_lse else out
    # Differentiable: the live rows gathered (one index select each), then one packed call.
    out, lse = attention_by_gather(q, k_cache, v_cache, block_table, lengths, is_causal=is_causal, scale=scale,
                                   window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                   backend=backend)
    return (out, lse) if return_lse else out
