"""Triton kernels for attn_ext.

The kernel modules (``cross_attention_fwd``, ``cross_attention_bwd``) import
Triton at import time, so import them only after
:func:`triton_unavailable_reason` has returned ``None``. This package itself
never imports Triton eagerly: ``import attn_ext`` must work on machines
without it.

On CPU the kernels only run through the Triton interpreter, which Triton
reads from ``TRITON_INTERPRET=1`` when a kernel is *decorated*; the variable
therefore has to be set before the kernel modules are first imported.
"""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["triton_unavailable_reason"]


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
                "interpreter (set TRITON_INTERPRET=1 before importing attn_ext.triton)")
    return f"device type {device.type!r} is not supported by the Triton kernels (need cuda)"
