"""Decoding on a GPU: few queries over many keys, the keys split over programs (FlashAttention's split-KV,
FlashInfer's split-k), each part's partial state merged after.

The forward's grid has a program per (query block, batch entry and head): a decoding step (a few new tokens over a
long cache) fills 8-64 of a GPU's 100+ SMs, each streaming its whole key range. :func:`key_split` cuts the keys
the call's queries can reach (the causal rule and the band bound them) into parts of a multiple of 128 keys, as
many as fill the SMs about twice; the kernel (``SPLIT_K``) then runs a third grid axis over the parts, each
program attending its part's keys and storing its partial ``(out, lse)`` in float32, and :func:`merge_parts`
combines them exactly as the online softmax would have (the same algebra as ``ae.merge_states``). Chosen by shape:
no split for a packed batch, with dropout, under the interpreter (unless a test asks), or when the grid already
fills the device.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
from torch import Tensor

from attn_ext.ops.utils.triton import interpreting

__all__ = ["KeySplit", "MAX_QUERIES", "MIN_PART_KEYS", "automatic_parts", "key_split", "merge_parts", "part_states"]

#: A part's keys, at least (fewer would cost more in the merge and the extra programs than they save).
MIN_PART_KEYS = 2048
#: A part's length is a multiple of the largest key tile, so that every part's blocks are aligned loads.
_ALIGN = 128
#: Query rows per program the split assumes (the smallest query tile).
_ROWS_PER_PROGRAM = 16
#: Queries per head up to which a call is decoding-like.
MAX_QUERIES = 16


class KeySplit(NamedTuple):
    """``parts`` programs per (query block, head), part ``p`` attending keys ``[base + p·length, base +
    (p + 1)·length)`` (clipped to the reachable keys by the kernel's own bounds)."""

    parts: int
    base: int
    length: int


def _reachable_keys(queries: int, keys: int, is_causal: bool, window: bool, band_lo: int, band_hi: int):
    """``[lo, hi)``: the keys some query of the call may attend (top-left causal: the first ``queries``; a band:
    from the first query's lowest to the last query's highest)."""
    if window:
        return max(0, band_lo), max(0, min(keys, queries - 1 + band_hi + 1))
    return 0, (min(keys, queries) if is_causal else keys)


def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def automatic_parts(heads: int, queries: int, keys: int, multiprocessors: int) -> int:
    """How many parts the keys of a call with ``heads`` (batch entries times query heads) of ``queries`` each,
    ``keys`` reachable keys, get on a device of ``multiprocessors`` SMs: 1 (no split) unless the call is
    decoding-like (at most :data:`MAX_QUERIES` queries) and its grid fills less than the SMs; then enough to fill
    them about twice, each part of :data:`MIN_PART_KEYS` keys or more."""
    if queries > MAX_QUERIES:
        return 1
    programs = heads * triton.cdiv(queries, _ROWS_PER_PROGRAM)
    if programs >= multiprocessors:
        return 1
    return max(1, min(triton.cdiv(2 * multiprocessors, programs), keys // MIN_PART_KEYS))


def key_split(heads: int, queries: int, keys: int, device: torch.device, is_causal: bool, window: bool, band_lo: int,
              band_hi: int, parts: Optional[int] = None) -> Optional[KeySplit]:
    """The split over programs of the keys of a (dropout-free) call of ``heads`` batch entries times query heads,
    ``queries`` rows and ``keys`` keys each (a packed batch: its sequences, longest lengths), on ``device``; None
    for one program per query block and head. ``parts`` forces a number of parts (tests under the interpreter); by
    default :func:`automatic_parts` on a CUDA device, none elsewhere. The parts cover the reachable keys (the causal
    rule and the band's sides, as the kernel reads them) from a multiple of 128 below their first."""
    lo, hi = _reachable_keys(queries, keys, is_causal, window, band_lo, band_hi)
    base = lo // _ALIGN * _ALIGN
    if parts is None:
        if interpreting() or device.type != "cuda":
            return None
        parts = automatic_parts(heads, queries, hi - base, _multiprocessors(device))
    if parts <= 1 or hi <= base:
        return None
    length = triton.cdiv(triton.cdiv(hi - base, parts), _ALIGN) * _ALIGN
    parts = triton.cdiv(hi - base, length)
    return None if parts <= 1 else KeySplit(parts, base, length)


def part_states(split: Optional[KeySplit], out: Tensor, lse: Tensor) -> tuple:
    """Where the forward kernel stores its states: ``(out, out strides, lse, lse strides, split arguments)``, the
    strides those of one part ``[B, H, M, ·]``; with a split, new float32 ``[P, B, H, M, Dv]`` and ``[P, B, H, M]``
    buffers (the merge's inputs) and the kernel's ``split_base, split_len`` and strides between parts; without,
    ``out`` and ``lse`` themselves."""
    if split is None:
        return out, out.stride(), lse, lse.stride(), (0, 0, 0, 0)
    parts = torch.empty((split.parts, *out.shape), dtype=torch.float32, device=out.device)
    lse_parts = torch.empty((split.parts, *lse.shape), dtype=torch.float32, device=lse.device)
    return (parts, parts.stride()[1:], lse_parts, lse_parts.stride()[1:],
            (split.base, split.length, parts.stride(0), lse_parts.stride(0)))


def merge_parts(out_parts: Tensor, lse_parts: Tensor, out: Tensor, lse: Tensor) -> None:
    """Writes into ``out`` ``[B, H, M, Dv]`` and ``lse`` ``[B, H, M]`` the state of the whole key set from the
    parts' float32 states ``[P, B, H, M, Dv]`` and ``[P, B, H, M]``: ``lse = logsumexp_p lse_p``, ``out =
    Σ_p exp(lse_p − lse)·out_p``. A part without a key (``lse_p = -inf``) weighs 0; a row without any key gives
    ``0`` and ``-inf``; a NaN in a part's state makes its row NaN."""
    total = torch.logsumexp(lse_parts, 0)
    weight = torch.where(torch.isneginf(lse_parts), 0.0, torch.exp(lse_parts - total))
    out.copy_((weight[..., None] * out_parts).sum(0))
    lse.copy_(total)
