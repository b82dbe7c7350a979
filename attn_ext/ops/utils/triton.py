"""What every Triton kernel of attn_ext shares: availability, device and dtype checks, tile helpers.

The kernel modules (``attn_ext/ops/<family>/triton_*.py``) import Triton at import time, so they
are imported only after :func:`triton_unavailable_reason` has returned ``None``. This module itself
never imports Triton eagerly: ``import attn_ext`` must work on machines without it.

On CPU the kernels only run through the Triton interpreter, which Triton
reads from ``TRITON_INTERPRET=1`` when a kernel is *decorated*; the variable
therefore has to be set before the kernel modules are first imported.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Optional

import torch

#: Input dtypes of every Triton kernel (no float64: use the cpp or reference backend).
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _triton_import_error() -> str | None:
    # find_spec alone would accept a broken install, so really import it; the
    # import is cached by Python after the first call.
    if importlib.util.find_spec("triton") is None:
        return "the 'triton' package is not installed"
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # a broken install raises more than ImportError
        return f"'triton' is installed but failed to import ({type(exc).__name__}: {exc})"
    return None


def triton_unavailable_reason(device: torch.device | str) -> str | None:
    """Say why the Triton kernels cannot run on ``device``.

    Parameters
    ----------
    device : torch.device or str
        Device of the tensors the kernels would receive.

    Returns
    -------
    str or None
        ``None`` when Triton is importable and either ``device`` is CUDA or
        ``device`` is CPU with ``TRITON_INTERPRET=1`` set; otherwise a short
        human-readable reason naming what is missing.
    """
    device = torch.device(device)
    error = _triton_import_error()
    if error is not None:
        return error
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "device is cuda but torch.cuda.is_available() is False"
        return None
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") == "1":
            return None
        return ("Triton kernels need a CUDA device; CPU tensors run only under the Triton "
                "interpreter (set TRITON_INTERPRET=1 before importing attn_ext)")
    return f"device type {device.type!r} is not supported by the Triton kernels (need cuda)"


def interpreting() -> bool:
    """Whether the kernels run in the Triton interpreter (CPU tensors, fixed tiles, no autotuning)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_device(kernel, *tensors: torch.Tensor) -> None:
    """All ``tensors`` on one device that ``kernel`` (a ``triton.jit`` function) can run on."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = next(iter(devices))
    # triton.jit chooses interpreter vs compiler when the kernel is decorated,
    # so an env var set after import would otherwise fail deep inside Triton.
    interpreted = type(kernel).__name__ == "InterpretedFunction"
    if device.type == "cpu" and not interpreted:
        raise RuntimeError("Triton kernels got CPU tensors but were not built for the interpreter; "
                           "set TRITON_INTERPRET=1 before importing attn_ext")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"Triton kernels need cuda tensors (or cpu under the interpreter), got {device}")


def check_dtypes(**tensors: torch.Tensor) -> torch.dtype:
    """The one dtype of ``tensors`` (by name), which the Triton kernels must support."""
    dtypes = {name: t.dtype for name, t in tensors.items()}
    dtype = next(iter(dtypes.values()))
    if dtype == torch.float64:
        raise TypeError("the Triton backend does not support float64; use the cpp or reference backend")
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"the Triton backend supports float32/float16/bfloat16, got {dtype}")
    if len(set(dtypes.values())) != 1:
        raise TypeError(f"{', '.join(dtypes)} must share one dtype, got {dtypes}")
    return dtype


def mask_arg(mask: Optional[torch.Tensor], fallback: torch.Tensor):
    """``(pointer tensor, stride_b, stride_n, has_mask)`` of a bool ``[B, N]`` padding mask.

    Without a mask ``fallback`` is passed, never dereferenced (HAS_MASK is a constexpr False). bool
    loads as i1, which some Triton paths treat awkwardly; uint8 is a free view.
    """
    if mask is None:
        return fallback, 0, 0, False
    m8 = mask.contiguous().view(torch.uint8)
    return m8, m8.stride(0), m8.stride(1), True


def next_pow2(x: int) -> int:
    """The smallest power of two >= max(x, 1)."""
    return 1 << (max(int(x), 1) - 1).bit_length()


def block_dim(d: int) -> int:
    """Padded width of a head dim for ``tl.dot``: a power of two, at least 16."""
    return max(16, next_pow2(d))


def lazily_autotuned(kernel, configs, key, **autotune_kwargs):
    """A function returning ``kernel`` wrapped in ``triton.autotune``, built on first call: the
    autotuner needs a GPU driver, which the interpreter (and ``import attn_ext``) must not."""
    import triton

    return functools.lru_cache(maxsize=None)(
        lambda: triton.autotune(configs=configs() if callable(configs) else configs, key=key, **autotune_kwargs)(kernel))
