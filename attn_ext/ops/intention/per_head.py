"""One check for the per-(batch, head) scalars of the Intention ops (``alpha``, ``theta``, lengthscales)."""
from __future__ import annotations

import torch
from torch import Tensor


def broadcast_per_head(prefix: str, name: str, value: Tensor, like: Tensor) -> Tensor:
    """``value`` expanded to ``[B, H] = like.shape[:2]`` (a view, so its gradient flows back), after checking
    that it is a real floating tensor on ``like``'s device whose shape broadcasts to exactly ``[B, H]``:
    a per-head ``[H]`` or a per-batch ``[B, 1]`` value is fine, one that would grow ``[B, H]`` is refused
    rather than silently broadcast. ``prefix`` starts every message (the op's name)."""
    B, H = like.shape[:2]
    if value.is_complex() or not value.is_floating_point():
        raise TypeError(f"{prefix}: {name} must be a real floating tensor, got {value.dtype}")
    if value.device != like.device:
        raise RuntimeError(f"{prefix}: {name} is on {value.device} but the inputs on {like.device}")
    try:
        shape = torch.broadcast_shapes(value.shape, (B, H))
    except RuntimeError:
        shape = None
    if shape != (B, H):
        raise ValueError(f"{prefix}: {name} must be a float or a tensor broadcastable to [B, H] = {[B, H]} "
                         f"(e.g. [H] per head), got shape {tuple(value.shape)}")
    return value.expand(B, H)
