"""The attention implementations the GPU benchmark times, each a ``fn(q, k, v, causal)`` on ``[B, H, N, D]``
CUDA tensors, and why one cannot run.

* ``sdpa-flash``, ``sdpa-cudnn``, ``sdpa-efficient``: ``torch.nn.functional.scaled_dot_product_attention``
  restricted to one backend with ``sdpa_kernel`` (it raises rather than falling back to another kernel);
* ``flex``: ``torch.nn.attention.flex_attention`` compiled once per process (``torch.compile``), with a
  block mask per causal shape built once and reused (building it is not timed);
* ``cuda``, ``triton``: ``attn_ext.scaled_dot_product_attention`` on that backend, the drop-in a user swaps in;
* ``triton-tma``: the same on ``triton`` with ``ATTN_EXT_TRITON_TMA=1`` (the Hopper forward and backward through
  TMA descriptors, the forward warp-specialised; opt-in until measured).
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Callable

import torch
from torch._dynamo import config as dynamo_config
from torch.nn.attention import SDPBackend, sdpa_kernel

import attn_ext as ae

SDPA_BACKENDS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION",
                 "sdpa-efficient": "EFFICIENT_ATTENTION"}
OURS = ("cuda", "triton")
TMA = "triton-tma"
IMPLS = (*SDPA_BACKENDS, "flex", *OURS, TMA)
#: The implementation every other one is checked against (the one FlashAttention's own tests trust).
REFERENCE = "sdpa-flash"


def _sdpa(backend_name: str) -> Callable:
    backend = getattr(SDPBackend, backend_name)

    def call(q, k, v, causal):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return call


#: FlexAttention compiles a kernel per shape, dtype and mask (tens of seconds each, not timed): the benchmark
#: runs it on bf16 only, 12 of the grid's 24 cases, which its compile-cache limit must hold.
FLEX_DTYPES = (torch.bfloat16,)


@functools.lru_cache(maxsize=None)
def _compiled_flex() -> Callable:
    # FlexAttention is imported where it is used: torch has it from 2.5 on, attn_ext supports 2.4, and
    # :func:`unavailable` reports its absence as the row's note instead of failing this module's import.
    from torch.nn.attention.flex_attention import flex_attention

    for name in ("recompile_limit", "cache_size_limit"):  # the name differs between torch releases
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), 64))
    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=None)
def _causal_block_mask(n: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask  # torch >= 2.5, see _compiled_flex

    return create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, B=None, H=None, Q_LEN=n, KV_LEN=n,
                             device=device)


def _flex(q, k, v, causal):
    block_mask = _causal_block_mask(q.shape[-2], str(q.device)) if causal else None
    return _compiled_flex()(q, k, v, block_mask=block_mask)


def _ours(backend: str) -> Callable:
    return lambda q, k, v, causal: ae.scaled_dot_product_attention(q, k, v, is_causal=causal, backend=backend)


@contextlib.contextmanager
def _tma_enabled():
    """``ATTN_EXT_TRITON_TMA=1`` for the block only (attn_ext reads it on every call), so that the other rows
    stay off the TMA kernels."""
    before = os.environ.get("ATTN_EXT_TRITON_TMA")
    os.environ["ATTN_EXT_TRITON_TMA"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["ATTN_EXT_TRITON_TMA"]
        else:
            os.environ["ATTN_EXT_TRITON_TMA"] = before


def _triton_tma(q, k, v, causal):
    with _tma_enabled():
        return ae.scaled_dot_product_attention(q, k, v, is_causal=causal, backend="triton")


def implementation(impl: str) -> Callable:
    if impl in SDPA_BACKENDS:
        return _sdpa(SDPA_BACKENDS[impl])
    if impl == "flex":
        return _flex
    if impl in OURS:
        return _ours(impl)
    if impl == TMA:
        return _triton_tma
    raise ValueError(f"unknown implementation {impl!r}; one of {IMPLS}")


def unavailable(impl: str, q: torch.Tensor) -> str | None:
    """Why ``impl`` cannot run on ``q``'s device and dtype, None if it may (SDPA's backends and Flex say so by
    raising on the first call, which the benchmark records as the row's note)."""
    if impl in OURS:
        return ae.available_backends(q)[impl]
    if impl == TMA:
        # Triton is optional: imported where the TMA row is asked about, after the backend said it can run.
        why = ae.available_backends(q)["triton"]
        if why is None:
            from attn_ext.ops.attention.triton_fwd_tma import tma_forward_unavailable_reason

            with _tma_enabled():
                why = tma_forward_unavailable_reason(q, q, q)
        return why
    if impl == "flex":
        if q.dtype not in FLEX_DTYPES:
            return "FlexAttention is benchmarked in bf16 only (each case costs a compile)"
        try:
            import torch.nn.attention.flex_attention  # noqa: F401 - torch >= 2.5 only, see _compiled_flex
        except ImportError as exc:
            return f"this torch has no FlexAttention ({exc})"
    return None
