"""Which kernel runs a call: chosen by device and availability, overridable by the caller.

Order of precedence: the ``backend=`` argument, then the ``ATTN_EXT_BACKEND`` environment variable,
then the automatic choice (CPU: ``cpp``; CUDA: ``triton``, then ``cuda``; anywhere: ``reference`` as
last resort). A backend that was asked for but cannot run raises, listing why each backend was
rejected.

``cpp`` and ``cuda`` are the same compiled ``torch.ops.attn_ext`` ops, which dispatch on the device:
the C++ kernels for CPU tensors, the hand-written CUDA kernels of ``csrc/cuda`` for CUDA tensors
(present only when the extension was built against a CUDA build of torch). The CUDA kernels have
been compiled and emulated on the host but never run on a GPU, so on CUDA the automatic choice
prefers Triton, and ``backend="cuda"`` must be asked for.
"""
from __future__ import annotations

import os
from typing import Dict, Optional

import torch
from torch import Tensor

from attn_ext._extension import extension_error

BACKENDS = ("cpp", "cuda", "triton", "reference")
#: Backends whose kernels are the compiled ``torch.ops.attn_ext`` ops (dispatched on the device).
COMPILED_BACKENDS = ("cpp", "cuda")
_AUTOMATIC_ORDER = {"cpu": ("cpp", "reference"), "cuda": ("triton", "cuda", "reference")}
ENVIRONMENT_VARIABLE = "ATTN_EXT_BACKEND"


def _cpp_rejection(q: Tensor) -> Optional[str]:
    error = extension_error()
    if error is not None:
        return error
    if q.device.type != "cpu":
        return f"the C++ kernels run on CPU tensors, got {q.device} (backend 'cuda' is the compiled kernels for CUDA)"
    return None


#: The op whose CUDA kernel decides whether backend "cuda" can run a call, unless the caller names another.
DEFAULT_OP = "attn_ext::cross_attention_fwd"


def _cuda_rejection(q: Tensor, op: str) -> Optional[str]:
    error = extension_error()
    if error is not None:
        return error
    if q.device.type != "cuda":
        return f"the CUDA kernels run on CUDA tensors, got {q.device}"
    # Per op: a build may carry CUDA kernels for some op families and not others.
    if not torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA"):
        return (f"this build of attn_ext has no CUDA kernel for {op} (it was compiled against a torch without "
                "CUDA, or before that kernel existed; reinstall with a CUDA build of torch and nvcc on PATH)")
    if q.dtype == torch.float64:
        return "the CUDA kernels take float16, bfloat16 or float32, not float64"
    return None


def _triton_rejection(q: Tensor) -> Optional[str]:
    from attn_ext.triton import triton_unavailable_reason

    reason = triton_unavailable_reason(q.device)
    if reason is not None:
        return reason
    if q.dtype == torch.float64:
        return "Triton kernels take float16, bfloat16 or float32, not float64"
    return None


def rejection_reasons(q: Tensor, op: str = DEFAULT_OP) -> Dict[str, Optional[str]]:
    """For each backend, None if it can run ``op`` (a ``"attn_ext::name"`` schema) on inputs like ``q``,
    else the reason it cannot."""
    return {"cpp": _cpp_rejection(q), "cuda": _cuda_rejection(q, op), "triton": _triton_rejection(q),
            "reference": None}


def available_backends(q: Tensor, op: str = DEFAULT_OP) -> Dict[str, Optional[str]]:
    """Public form of :func:`rejection_reasons`: ``{name: None or reason}`` for inputs like ``q``."""
    return rejection_reasons(q, op)


def select_backend(requested: Optional[str], q: Tensor, op: str = DEFAULT_OP) -> str:
    """The backend to run ``q``'s call of ``op`` on; raises RuntimeError if a requested one cannot run it."""
    if requested is None or requested == "auto":
        requested = os.environ.get(ENVIRONMENT_VARIABLE) or "auto"
    if requested != "auto" and requested not in BACKENDS:
        raise ValueError(f"attn_ext: unknown backend {requested!r}; choose one of {', '.join(BACKENDS)} or 'auto'")
    reasons = rejection_reasons(q, op)
    if requested != "auto":
        if reasons[requested] is None:
            return requested
        listing = "; ".join(f"{name}: {reason or 'available'}" for name, reason in reasons.items())
        raise RuntimeError(f"attn_ext: backend {requested!r} cannot run on {q.device} {q.dtype} inputs ({listing})")
    for name in _AUTOMATIC_ORDER.get(q.device.type, ("reference",)):
        if reasons[name] is None:
            return name
    return "reference"
