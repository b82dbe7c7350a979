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


#: Environment variable that pins every autotuned kernel to one config (see :func:`pinning`).
PIN_ENV = "ATTN_EXT_TRITON_PIN"


def pinning() -> bool:
    """Whether ``ATTN_EXT_TRITON_PIN=1``: every autotuned Triton kernel runs one config, not a sweep.

    Autotuning compiles and times every kept config on the first call of each tuning key (6 to 12
    compiles, one tree kernel alone takes about 12 s), which a test suite of many small shapes pays
    over and over, for speed it does not measure. Pinned, each call runs the one config that
    :func:`pinned_configs` chooses among the configs its pruning keeps for that call, so the result is
    as correct as the autotuned one (every config computes the same thing; the GPU test
    ``python_tests/gpu/test_gpu_triton_configs.py`` runs every config). Read lazily, when a kernel's
    autotuner is built (its first launch on a GPU): set it before the first launch of the process.
    """
    return os.environ.get(PIN_ENV) == "1"


def config_tiles(config) -> tuple:
    """``(sorted constexpr items, num_warps, num_stages)`` of a ``triton.Config``: what identifies it."""
    return tuple(sorted(config.kwargs.items())), config.num_warps, config.num_stages


def pinned_configs(survivors, full=None, preferred=None) -> list:
    """The one config, as a one-element list, that a pinned autotuner runs among ``survivors``.

    ``survivors`` are the configs of ``full`` (default: ``survivors`` itself) that the kernel's pruning
    kept for this call, in ``full``'s order; ``full`` lists each kernel's configs from the smallest to the
    largest tiles. The choice is ``preferred`` (a ``triton.Config`` or its :func:`config_tiles`: the
    kernel's named default, what its autotuner is expected to pick at typical sizes) when it survived,
    else the last survivor listed before it (the largest smaller tile), else the first survivor; with no
    ``preferred``, the last survivor (the largest tile that the pruning allows). Always one of
    ``survivors``, so the pruning's guarantees (shared memory, problem size) hold for the pinned config.
    """
    survivors = list(survivors)
    if not survivors:
        raise ValueError("pinned_configs: no config to pin (the pruning kept none)")
    full = survivors if full is None else list(full)
    if preferred is None:
        return [survivors[-1]]
    want = preferred if isinstance(preferred, tuple) else config_tiles(preferred)
    order = [config_tiles(c) for c in full]
    limit = order.index(want) if want in order else len(order)
    before = [c for c in survivors if config_tiles(c) in order and order.index(config_tiles(c)) <= limit]
    return [before[-1] if before else survivors[0]]


def tuning_plan(configs, prune=None, preferred=None):
    """``(configs, early_config_prune)`` that ``triton.autotune`` gets for a kernel, as :func:`pinning` says.

    Not pinned: ``configs`` and ``prune`` as given. Pinned without a pruning: the one config of
    :func:`pinned_configs` (the autotuner runs it without timing). Pinned with a pruning: all
    ``configs`` and a pruning that keeps the one pinned survivor of ``prune`` per call (Triton times
    nothing when the pruning keeps one config), so a shape-dependent pruning still chooses per call.
    """
    configs = list(configs() if callable(configs) else configs)
    if not pinning():
        return configs, prune
    if prune is None:
        return pinned_configs(configs, preferred=preferred), None

    def pinned_prune(candidates, named_args, **kwargs):
        return pinned_configs(prune(candidates, named_args, **kwargs), configs, preferred)

    return configs, pinned_prune


def lazily_autotuned(kernel, configs, key, prune=None, preferred=None):
    """A function returning ``kernel`` wrapped in ``triton.autotune`` over :func:`tuning_plan`'s configs,
    built on first call: the autotuner needs a GPU driver, which the interpreter (and ``import attn_ext``)
    must not. ``configs`` is a list or a function returning one; ``prune`` an ``early_config_prune``."""

    def build():
        import triton

        tuned, pruning = tuning_plan(configs, prune, preferred)
        kwargs = {"prune_configs_by": {"early_config_prune": pruning}} if pruning is not None else {}
        return triton.autotune(configs=tuned, key=list(key), **kwargs)(kernel)

    return functools.lru_cache(maxsize=None)(build)
