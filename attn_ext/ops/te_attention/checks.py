"""Argument checks of ``ae.te_attention`` and its Python backends' ops, with the messages of the C++ ops'
(``csrc/checks/te_attention_checks.h``): every message names the op and the shapes or values it got."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from attn_ext.ops.utils.dtypes import SUPPORTED_DTYPES
from attn_ext.ops.utils.validation import is_int_scalar, is_real_scalar

WHO = "attn_ext.te_attention"
TENSOR_NAMES = ("q", "k", "v", "xq", "xk", "w1", "b1", "w2", "b2")


def check_te_attention_args(q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask, scale, activation: int,
                            chunk_size) -> None:
    """Raises TypeError / ValueError / RuntimeError for arguments the op cannot take (see the op's docstring)."""
    tensors = (q, k, v, xq, xk, w1, b1, w2, b2)
    for name, t in zip(TENSOR_NAMES, tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"{WHO}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if (q.dim(), k.dim(), v.dim(), xq.dim(), xk.dim()) != (4, 4, 4, 3, 3):
        raise ValueError(f"{WHO}: expected q [B, H, M, D], k [B, H, N, D], v [B, H, N, Dv], xq [B, M, dx], xk [B, N, "
                         f"dx]; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, xq {tuple(xq.shape)}, "
                         f"xk {tuple(xk.shape)}")
    B, H, M, D = q.shape
    N, dx = k.shape[2], xq.shape[2]
    if (tuple(k.shape) != (B, H, N, D) or tuple(v.shape[:3]) != (B, H, N) or tuple(xq.shape) != (B, M, dx)
            or tuple(xk.shape) != (B, N, dx)):
        raise ValueError(f"{WHO}: expected q [B, H, M, D], k [B, H, N, D], v [B, H, N, Dv], xq [B, M, dx], xk [B, N, "
                         f"dx] with one B, H, M, N, D and dx; got q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)}, xq {tuple(xq.shape)}, xk {tuple(xk.shape)}")
    hidden = w1.shape[0] if w1.dim() == 2 else -1
    if (w1.dim() != 2 or w1.shape[1] != H + dx or tuple(b1.shape) != (hidden,) or tuple(w2.shape) != (H, hidden)
            or tuple(b2.shape) != (H,)):
        raise ValueError(f"{WHO}: the MLP's weights must be w1 [hidden, H + dx] = [hidden, {H + dx}], b1 [hidden], "
                         f"w2 [H, hidden] = [{H}, hidden], b2 [H] = [{H}]; got w1 {tuple(w1.shape)}, b1 "
                         f"{tuple(b1.shape)}, w2 {tuple(w2.shape)}, b2 {tuple(b2.shape)}")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise TypeError(f"{WHO}: q, k, v, xq, xk, w1, b1, w2, b2 must share one dtype, got "
                        + ", ".join(f"{n} {t.dtype}" for n, t in zip(TENSOR_NAMES, tensors)))
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{WHO}: takes float16, bfloat16, float32 or float64, not {q.dtype}")
    devices = {t.device for t in tensors}
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor):
            raise TypeError(f"{WHO}: key_padding_mask must be a bool tensor or None, got {type(key_padding_mask).__name__}")
        if tuple(key_padding_mask.shape) != (B, N):
            raise ValueError(f"{WHO}: key_padding_mask must be [B, N] = [{B}, {N}], got {tuple(key_padding_mask.shape)}")
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(f"{WHO}: key_padding_mask must be bool (True = padding), got {key_padding_mask.dtype}")
        devices.add(key_padding_mask.device)
    if len(devices) != 1:
        raise RuntimeError(f"{WHO}: every tensor must be on one device, got {sorted(str(d) for d in devices)}")
    if not is_real_scalar(scale) or not math.isfinite(scale):
        raise ValueError(f"{WHO}: scale must be a finite float, got {scale!r}")
    if not is_int_scalar(activation) or not 0 <= activation < 4:
        raise ValueError(f"{WHO}: activation must be 0 (relu), 1 (gelu), 2 (silu) or 3 (tanh), got {activation!r}")
    if not is_int_scalar(chunk_size) or chunk_size < 0:
        raise ValueError(f"{WHO}: chunk_size must be >= 0 (0: the kernel's choice), got {chunk_size!r}")
