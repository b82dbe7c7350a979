"""Argument checks shared by the Intention variants (pinv, convex regulariser, kernelised, the map ``w(K, V)``).

The shared validators of :mod:`attn_ext.ops.utils.validation` say ``attn_ext: ...``; a variant re-raises
their errors with its own name (``attn_ext.pinv_intention: ...``) so that a user of a composed op sees
which call was wrong, not which helper noticed it.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator, Optional, Union

import torch
from torch import Tensor

from attn_ext.ops.intention.per_head import broadcast_per_head
from attn_ext.ops.intention.ridge import _scale
from attn_ext.ops.intention.state import IntentionState
from attn_ext.ops.utils.concrete import check_on_device, concrete, tracing
from attn_ext.ops.utils.dtypes import accumulation_dtype
from attn_ext.ops.utils.validation import check_cross_attention_args, is_real_scalar

ScalarOrTensor = Union[float, Tensor]
_PREFIX = "attn_ext: "


@contextmanager
def named(op: str, *inner: str) -> Iterator[None]:
    """Re-raises the shared validators' errors (``attn_ext: ...``), and those of the ops ``inner`` it calls
    (``attn_ext.intention: ...``), as ``attn_ext.<op>: ...`` with the same type and the rest of the text."""
    try:
        yield
    except (ValueError, TypeError, RuntimeError) as err:
        message = str(err)
        for prefix in (_PREFIX, *(f"attn_ext.{name}: " for name in inner)):
            if message.startswith(prefix):
                raise type(err)(f"attn_ext.{op}: {message[len(prefix):]}") from err
        raise


def check_qkv(op: str, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], scale) -> float:
    """The checks of :func:`attn_ext.intention` (shapes, dtypes, devices, mask, scale), named after ``op``;
    returns ``scale`` as a float."""
    with named(op):
        check_cross_attention_args(q, k, v, key_padding_mask, None, None)
        return _scale(scale)


def check_keys(op: str, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor]) -> None:
    """The checks of the keys and values alone (a stand-in query of the keys' shape)."""
    with named(op):
        if not isinstance(k, Tensor) or k.dim() != 4:
            raise ValueError(f"attn_ext: k must be a 4-D tensor [B, H, N, D], got {getattr(k, 'shape', k)!r}")
        check_cross_attention_args(k[:, :, :0], k, v, key_padding_mask, None, None)


def check_state(op: str, state) -> IntentionState:
    if not isinstance(state, IntentionState):
        raise TypeError(f"attn_ext.{op}: state must be an IntentionState (from attn_ext.intention_state), "
                        f"got {type(state).__name__}")
    return state


def check_state_query(op: str, q: Tensor, state: IntentionState) -> None:
    """``q [B, H, M, D]`` against the state's ``gram [B, H, D, D]``."""
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise ValueError(f"attn_ext.{op}: q must be a 4-D tensor [B, H, M, D], got {getattr(q, 'shape', q)!r}")
    B, H, D = state.gram.shape[:3]
    if (q.shape[0], q.shape[1], q.shape[3]) != (B, H, D):
        raise ValueError(f"attn_ext.{op}: q {tuple(q.shape)} does not match the state (gram "
                         f"{tuple(state.gram.shape)}): need [B, H, M, D] = [{B}, {H}, M, {D}]")
    if not q.is_floating_point() or q.is_complex():
        raise TypeError(f"attn_ext.{op}: q must be a real floating tensor, got {q.dtype}")
    if q.device != state.gram.device:
        raise RuntimeError(f"attn_ext.{op}: q is on {q.device} but the state on {state.gram.device}")


def per_head(op: str, name: str, value: ScalarOrTensor, like: Tensor, *, positive: bool = False,
             allow_infinite: bool = False) -> Tensor:
    """``value`` (a real scalar, or a tensor broadcastable to ``[B, H] = like.shape[:2]``) as a ``[B, H]``
    tensor; a tensor keeps its dtype (and its gradient), a scalar gets ``like``'s accumulation dtype.

    Refuses NaN, infinities (unless ``allow_infinite``) and, with ``positive``, values ``<= 0``.
    """
    B, H = like.shape[:2]
    if isinstance(value, Tensor):
        tensor = broadcast_per_head(f"attn_ext.{op}", name, value, like)
        if value.device.type != "meta":
            _check_values(op, name, value.detach(), positive, allow_infinite)
        return tensor
    if not is_real_scalar(value):
        raise TypeError(f"attn_ext.{op}: {name} must be a real number or a tensor, got {value!r}")
    _check_values(op, name, torch.tensor([float(value)], dtype=torch.float64), positive, allow_infinite)
    return torch.full((B, H), float(value), dtype=accumulation_dtype(like.dtype), device=like.device)


def _check_values(op: str, name: str, values: Tensor, positive: bool, allow_infinite: bool) -> None:
    """ValueError naming ``op`` for a bad value; under ``torch.compile`` an assert op that raises
    ``RuntimeError`` with the same rule when the compiled graph runs."""
    bad = torch.isnan(values)
    if not allow_infinite:
        bad = bad | torch.isinf(values)
    if positive:
        bad = bad | (values <= 0)
    need = ("positive" if positive else "real") + ("" if allow_infinite else " and finite")
    if tracing():
        check_on_device(~bad, f"attn_ext.{op}: {name} must be {need}")
        return
    if bool(concrete(bad).any()):
        raise ValueError(f"attn_ext.{op}: {name} must be {need}, got {concrete(values).flatten()[:8].tolist()}")


def non_negative_float(op: str, name: str, value, *, allow_none: bool = False) -> Optional[float]:
    """A finite real ``>= 0`` as a float (None passes through where allowed)."""
    if value is None and allow_none:
        return None
    if not (is_real_scalar(value) and math.isfinite(value) and value >= 0):
        raise ValueError(f"attn_ext.{op}: {name} must be a finite float >= 0, got {value!r}")
    return float(value)
