"""Argument checks of the public API: clear errors naming the shapes, nothing broadcast silently."""
from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
from torch import Tensor

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def is_real_scalar(value) -> bool:
    """A real number that is not a bool: ``int``, ``float``, NumPy scalars, ``Fraction`` (what
    ``numbers.Real`` registers), as SDPA takes for ``scale``. Tensors are not scalars here."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_int_scalar(value) -> bool:
    """An integer that is not a bool: ``int`` and NumPy integer scalars (``numbers.Integral``; NumPy's
    bool is not registered there). A float, even a whole one, is not an integer."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def error_prefix(op: Optional[str]) -> str:
    """``"attn_ext.<op>: "``, the start of every error an op raises, so that the message names the public call
    that was wrong; ``"attn_ext: "`` without an op (callers that rename the errors themselves, e.g. the
    Intention variants' ``named``)."""
    return f"attn_ext.{op}: " if op else "attn_ext: "


def check_scale(scale, op: Optional[str] = None) -> Optional[float]:
    """``scale`` as a Python float (None stays None, the op's default); ValueError unless finite real."""
    if scale is None:
        return None
    if not (is_real_scalar(scale) and math.isfinite(scale)):
        raise ValueError(f"{error_prefix(op)}scale must be a finite float, got {scale!r}")
    return float(scale)


def check_chunk_size(chunk_size, op: Optional[str] = None) -> Optional[int]:
    """``chunk_size`` as a Python int (None stays None); ValueError unless a positive integer."""
    if chunk_size is None:
        return None
    if not (is_int_scalar(chunk_size) and chunk_size > 0):
        raise ValueError(f"{error_prefix(op)}chunk_size must be a positive int, got {chunk_size!r}")
    return int(chunk_size)


def _valid_cross_attention_tensors(q, k, v, key_padding_mask) -> bool:
    """True when q, k, v and the mask pass every check below: one pass over the facts a valid call
    has (a microsecond, a third of the checks that name what is wrong), run before them on every call."""
    if not (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor):
        return False
    qs, ks, vs = q.shape, k.shape, v.shape
    if not (len(qs) == 4 and len(ks) == 4 and len(vs) == 4):
        return False
    batch, heads, _, head_dim = qs
    dtype, device = q.dtype, q.device
    if not (ks[0] == batch == vs[0] and ks[1] == heads == vs[1] and ks[3] == head_dim > 0 and ks[2] == vs[2]
            and k.dtype == dtype and v.dtype == dtype and dtype in SUPPORTED_DTYPES
            and k.device == device and v.device == device):
        return False
    if key_padding_mask is None:
        return True
    return (type(key_padding_mask) is Tensor and key_padding_mask.dtype == torch.bool
            and key_padding_mask.shape == (batch, ks[2]) and key_padding_mask.device == device)


def check_cross_attention_args(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], scale: Optional[float],
    chunk_size: Optional[int], op: Optional[str] = None,
) -> None:
    """Raises TypeError/ValueError/RuntimeError for inputs that do not follow docs/spec.md §0, each message
    starting with :func:`error_prefix` of ``op`` (the public op that was called).

    ``scale`` may be any finite real scalar and ``chunk_size`` any positive integer scalar (NumPy's
    included, bools not).
    """
    if _valid_cross_attention_tensors(q, k, v, key_padding_mask):
        check_chunk_size(chunk_size, op)
        check_scale(scale, op)
        return
    prefix = error_prefix(op)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{prefix}{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"{prefix}q, k, v must be 4-D [B, H, M, D], [B, H, N, D], [B, H, N, Dv]; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if not (q.shape[0] == k.shape[0] == v.shape[0] and q.shape[1] == k.shape[1] == v.shape[1]):
        raise ValueError(
            f"{prefix}batch and head sizes of q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must match"
        )
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"{prefix}q {tuple(q.shape)} and k {tuple(k.shape)} must have the same head dim D")
    if q.shape[3] == 0:
        raise ValueError(f"{prefix}head dim D must be positive, got q {tuple(q.shape)}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"{prefix}k {tuple(k.shape)} and v {tuple(v.shape)} must have the same number of keys N")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{prefix}q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{prefix}dtype {q.dtype} is not supported; use float16, bfloat16, float32 or float64")
    if not (q.device == k.device == v.device):
        raise RuntimeError(f"{prefix}q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor):
            raise TypeError(f"{prefix}key_padding_mask must be a bool tensor, got {type(key_padding_mask).__name__}")
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(
                f"{prefix}key_padding_mask must be bool (True = padding, ignored), got {key_padding_mask.dtype}"
            )
        expected = (k.shape[0], k.shape[2])
        if tuple(key_padding_mask.shape) != expected:
            raise ValueError(
                f"{prefix}key_padding_mask must be [B, N] = {list(expected)} for k {tuple(k.shape)}, "
                f"got {list(key_padding_mask.shape)}"
            )
        if key_padding_mask.device != k.device:
            raise RuntimeError(f"{prefix}key_padding_mask is on {key_padding_mask.device} but k is on {k.device}")
    # The callers convert with float() / int() (or check_scale / check_chunk_size) before the kernels.
    check_chunk_size(chunk_size, op)
    check_scale(scale, op)
