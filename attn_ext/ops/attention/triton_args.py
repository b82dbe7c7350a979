"""Argument checks of the Triton attention op pair: what every backend of the op requires (shapes of
q, k, v with grouped key/value heads, the masks, dropout), with errors naming the op."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from attn_ext.ops.utils.validation import check_chunk_size, check_scale

__all__ = ["check_attention_args"]

_OP = "attn_ext attention (triton)"


def check_attention_args(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
                         key_padding_mask: Optional[Tensor], scale: float, dropout_p: float,
                         dropout_seed: Optional[Tensor], chunk_size: int) -> None:
    """Raise TypeError/ValueError unless ``q [B, Hq, L, D]``, ``k [B, Hkv, S, D]``, ``v [B, Hkv, S, Dv]``
    with ``Hq % Hkv == 0`` (or ``Hq = Hkv = 0``), ``attn_mask`` None or ``[B, Hq, L, S]`` bool or q's dtype,
    ``key_padding_mask`` None or bool ``[B, S]``, ``0 <= dropout_p < 1`` (with an int64 one-element
    ``dropout_seed`` when positive) and a finite scale and positive chunk size."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{_OP}: {name} must be a 4-D tensor, got "
                             f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
    B, Hq, L, D = q.shape
    _, Hkv, S, _ = k.shape
    if k.shape[0] != B or tuple(v.shape[:3]) != (B, Hkv, S) or k.shape[3] != D:
        raise ValueError(f"{_OP}: expected q [B, Hq, L, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv]; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if (Hq % Hkv != 0) if Hkv > 0 else Hq > 0:  # Hq = Hkv = 0: an empty problem
        raise ValueError(f"{_OP}: the query heads ({Hq}) must be a multiple of the key/value heads ({Hkv})")
    if D == 0:
        raise ValueError(f"{_OP}: head dim D must be positive, got q {tuple(q.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{_OP}: q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if attn_mask is not None:
        if tuple(attn_mask.shape) != (B, Hq, L, S):
            raise ValueError(f"{_OP}: attn_mask must have shape {(B, Hq, L, S)}, got {tuple(attn_mask.shape)}")
        if attn_mask.dtype not in (torch.bool, q.dtype):
            raise TypeError(f"{_OP}: attn_mask must be bool or {q.dtype}, got {attn_mask.dtype}")
    if key_padding_mask is not None and (key_padding_mask.dtype != torch.bool
                                         or tuple(key_padding_mask.shape) != (B, S)):
        raise ValueError(f"{_OP}: key_padding_mask must be bool {(B, S)}, got "
                         f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}")
    if check_scale(scale) is None:
        raise ValueError(f"{_OP}: scale must be a finite float, got None")
    if check_chunk_size(chunk_size) is None:
        raise ValueError(f"{_OP}: chunk_size must be a positive int, got None")
    if not (isinstance(dropout_p, (int, float)) and math.isfinite(dropout_p) and 0.0 <= dropout_p < 1.0):
        raise ValueError(f"{_OP}: dropout_p must be in [0, 1), got {dropout_p!r}")
    if dropout_p > 0.0 and (not isinstance(dropout_seed, Tensor) or dropout_seed.dtype != torch.int64
                            or dropout_seed.numel() != 1):
        raise ValueError(f"{_OP}: dropout_p > 0 needs dropout_seed, an int64 tensor of one element; got "
                         f"{dropout_seed!r}")
