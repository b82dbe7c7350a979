"""Op ``paged_attention_fwd`` (forward only): its reference and Triton backends, fake kernel, the refusal of
derivatives, and the backends :func:`attn_ext.paged_attention` dispatches to (``cpp``: the C++ kernels reading the
cache through the block table, ``csrc/cpu/attention_ops.cpp``; ``triton``: the forward kernel reading it through the
block table too, :mod:`.triton_paged`; ``reference``: a gather and the packed reference).

Derivatives are refused here by design: the public function takes the differentiable route (a gather, then
:func:`attn_ext.varlen_attention`) whenever an input requires a gradient.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from attn_ext.ops.attention.varlen import varlen_attention
from attn_ext.ops.utils.autograd import register_not_differentiable
from attn_ext.ops.utils.dispatch import Implementation, declare
from attn_ext.ops.utils.dtypes import accumulation_dtype
from attn_ext.ops.utils.extension import extension_error
from attn_ext.ops.utils.registration import define_op

__all__ = ["PAGED_ATTENTION", "attention_by_gather", "gather_cache", "paged_attention_fwd_reference",
           "paged_attention_fwd_triton"]


def gather_cache(cache: Tensor, block_table: Tensor, lengths: list) -> Tensor:
    """The live rows of every entry of a paged ``cache [num_blocks, block_size, Hkv, ·]``, entry after entry:
    ``[Σ lengths, Hkv, ·]`` (one index select; differentiable)."""
    block_size = cache.shape[1]
    positions = torch.arange(max(lengths, default=0), device=block_table.device)
    rows = [block_table[b, positions[:n] // block_size].long() * block_size + positions[:n] % block_size
            for b, n in enumerate(lengths)]
    index = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long, device=block_table.device)
    return cache.reshape(cache.shape[0] * block_size, *cache.shape[2:]).index_select(0, index.to(cache.device))


def _extension_reason(x: Tensor, context) -> Optional[str]:
    if extension_error() is not None or not hasattr(torch.ops.attn_ext, "paged_attention_fwd"):
        return "this build of attn_ext has no paged_attention_fwd; rebuild the extension (pip install -e .)"
    return None


def attention_by_gather(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, lengths: list,
                        **kwargs) -> Tuple[Tensor, Tensor]:
    """``(out [B, H, M, Dv], lse [B, H, M])``: each entry's live rows gathered (:func:`gather_cache`), then one
    :func:`~attn_ext.varlen_attention` over them aligned bottom-right (``kwargs``: its keywords); differentiable."""
    B, H, M, D = q.shape
    k, v = gather_cache(k_cache, block_table, lengths), gather_cache(v_cache, block_table, lengths)
    cu_q = torch.arange(B + 1, dtype=torch.int32) * M
    cu_k = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    out, lse = varlen_attention(q.transpose(1, 2).reshape(B * M, H, D), k, v, cu_q, cu_k, alignment="bottom_right",
                                return_lse=True, **kwargs)
    return out.reshape(B, M, H, v.shape[-1]).transpose(1, 2), lse.reshape(H, B, M).transpose(0, 1)


@define_op("attn_ext::paged_attention_fwd_reference")
def paged_attention_fwd_reference(q, k_cache, v_cache, block_table, cache_seqlens, scale, is_causal, window_left,
                                  window_right, softcap, alibi_slopes, chunk_size):
    out, lse = attention_by_gather(q, k_cache, v_cache, block_table, [int(n) for n in cache_seqlens.tolist()],
                                   is_causal=is_causal, scale=scale, window_size=(window_left, window_right),
                                   softcap=softcap or None, alibi_slopes=alibi_slopes, chunk_size=chunk_size,
                                   backend="reference")
    return out.contiguous(), lse.contiguous()


@define_op("attn_ext::paged_attention_fwd_triton")
def paged_attention_fwd_triton(q, k_cache, v_cache, block_table, cache_seqlens, scale, is_causal, window_left,
                               window_right, softcap, alibi_slopes, chunk_size):
    from attn_ext.ops.attention import triton_paged  # optional dependency: Triton

    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table),
                    ("cache_seqlens", cache_seqlens)):
        if t.device != q.device:
            raise RuntimeError(f"attn_ext.paged_attention (triton): {name} is on {t.device} but q is on {q.device}")
    slopes = None if alibi_slopes is None else alibi_slopes.to(torch.float32).contiguous()
    return triton_paged.paged_forward(q, k_cache, v_cache, block_table, [int(n) for n in cache_seqlens.tolist()],
                                      scale, is_causal, window_left, window_right, softcap, slopes, chunk_size)


def _fake_paged(q, k_cache, v_cache, block_table, cache_seqlens, *_rest):
    B, H, M, _ = q.shape
    return q.new_empty((B, H, M, v_cache.shape[-1])), q.new_empty((B, H, M), dtype=accumulation_dtype(q.dtype))


_REASON = ("by design: ae.paged_attention differentiates through a gather of the live cache rows whenever an "
           "input requires a gradient")
for _name in ("attn_ext::paged_attention_fwd_reference", "attn_ext::paged_attention_fwd_triton"):
    torch.library.register_fake(_name)(_fake_paged)
    register_not_differentiable(_name, _REASON)
if extension_error() is None and hasattr(torch.ops.attn_ext, "paged_attention_fwd"):
    torch.library.register_fake("attn_ext::paged_attention_fwd")(_fake_paged)
    register_not_differentiable("attn_ext::paged_attention_fwd", _REASON)

PAGED_ATTENTION = declare(
    "paged_attention",
    cpp=Implementation("paged_attention_fwd", (_extension_reason,)),
    triton=Implementation(paged_attention_fwd_triton),
    reference=Implementation(paged_attention_fwd_reference))
