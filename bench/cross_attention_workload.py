"""The cross-attention benchmark workload: shapes, inputs, implementations, calls.

Shared by the ``python -m bench run`` runner (:mod:`bench.bench_cross_attention`)
and the pytest-benchmark suite in ``bench/``, so both time exactly the same calls.

Implementations
---------------
``"ours"``
    ``attn_ext.cross_attention(q, k, v, backend=backend)``.
``"sdpa"``
    ``torch.nn.functional.scaled_dot_product_attention`` with PyTorch's own
    kernel choice (the flash CPU kernel for fp32 without a mask).
``"sdpa-math"``
    SDPA forced onto its math path, which materialises the ``[B, H, M, N]``
    scores; used only to check the memory method against a known size.

Passes
------
``"fwd"``
    Forward only, inputs without ``requires_grad``.
``"fwd+bwd"``
    Forward, then ``torch.autograd.grad(out, (q, k, v), grad_out)`` with a fixed
    random ``grad_out`` (the gradient of ``(out * grad_out).sum()``).
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch

B, H, M, D, DV = 8, 4, 128, 64, 64
DTYPE = torch.float32
QUICK_NS: tuple[int, ...] = (1_000, 10_000, 100_000)
FULL_NS: tuple[int, ...] = QUICK_NS + (300_000,)
IMPLS: tuple[str, ...] = ("ours", "sdpa")
PASSES: tuple[str, ...] = ("fwd", "fwd+bwd")

#: Flops per B*H*M*N*D. Forward: QK^T and PV, 2 flops per multiply-add each.
#: Backward: recomputed QK^T, dO V^T, P^T dO, dS K, dS^T Q (D == Dv here).
FLOP_FACTOR = {"fwd": 4, "fwd+bwd": 4 + 10}

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def flops(n: int, pass_: str) -> int:
    """Flops counted for one call of ``pass_`` with ``n`` keys (see FLOP_FACTOR)."""
    return FLOP_FACTOR[pass_] * B * H * M * n * D


def input_bytes(n: int) -> int:
    """Bytes of K and V together with ``n`` keys, to put memory figures in scale."""
    return B * H * n * (D + DV) * torch.finfo(DTYPE).bits // 8


def score_bytes(n: int) -> int:
    """Bytes of one fp32 ``[B, H, M, N]`` score matrix, the math path's minimum."""
    return B * H * M * n * 4


def make_inputs(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``q [B,H,M,D]``, ``k [B,H,n,D]``, ``v [B,H,n,Dv]`` (fp32, CPU, no grad)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, M, D, generator=gen, dtype=DTYPE)
    k = torch.randn(B, H, n, D, generator=gen, dtype=DTYPE)
    v = torch.randn(B, H, n, DV, generator=gen, dtype=DTYPE)
    return q, k, v


def implementation(impl: str, backend: str = "cpp") -> Attention:
    """Attention callable ``f(q, k, v) -> out`` for ``impl``.

    Parameters
    ----------
    impl : {"ours", "sdpa", "sdpa-math"}
    backend : str
        attn_ext backend, used by ``"ours"`` only.

    Raises
    ------
    ValueError
        Unknown ``impl``.
    AttributeError, ImportError
        ``"ours"`` while ``attn_ext.cross_attention`` is not importable.
    """
    if impl == "ours":
        # Looked up at call time so a stand-in assigned to attn_ext.cross_attention is used.
        op = importlib.import_module("attn_ext").cross_attention

        def ours(q, k, v):
            return op(q, k, v, backend=backend)

        return ours
    if impl == "sdpa":
        return torch.nn.functional.scaled_dot_product_attention
    if impl == "sdpa-math":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa_math(q, k, v):
            with sdpa_kernel(SDPBackend.MATH):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)

        return sdpa_math
    raise ValueError(f"unknown implementation {impl!r}; expected one of {IMPLS + ('sdpa-math',)}")


def impl_label(impl: str, backend: str) -> str:
    """Human-readable name of ``impl`` for tables and progress lines."""
    return {"ours": f"cross_attention[{backend}]", "sdpa": "sdpa", "sdpa-math": "sdpa[math]"}[impl]


def make_call(
    fn: Attention, pass_: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> Callable[[], object]:
    """Zero-argument callable running ``pass_`` of ``fn`` on the given inputs.

    For ``"fwd+bwd"`` the inputs are switched to ``requires_grad`` in place
    (they are leaves) and a fixed ``grad_out`` is drawn once, so every repeat
    does identical work. ``autograd.grad`` is used instead of ``.backward()``
    so no ``.grad`` accumulates across repeats.
    """
    if pass_ == "fwd":
        for t in (q, k, v):
            t.requires_grad_(False)
        return lambda: fn(q, k, v)
    if pass_ != "fwd+bwd":
        raise ValueError(f"unknown pass {pass_!r}; expected one of {PASSES}")
    for t in (q, k, v):
        t.requires_grad_(True)
    grad_out = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=torch.Generator().manual_seed(1), dtype=q.dtype)

    def fwd_bwd():
        out = fn(q, k, v)
        return torch.autograd.grad(out, (q, k, v), grad_out)

    return fwd_bwd


def memory_probe(impl: str, n: int, backend: str = "cpp") -> Callable[[], object]:
    """Target of :func:`bench.harness.memory.measure_peak_extra`: one forward.

    Builds the inputs now (so they are part of the baseline, not of the peak)
    and returns the forward call to measure.
    """
    q, k, v = make_inputs(n)
    return make_call(implementation(impl, backend), "fwd", q, k, v)


def check_ours(backend: str, atol: float = 1e-4) -> tuple[str | None, str | None]:
    """Smoke-test ``"ours"`` on a small problem before spending minutes timing it.

    Returns
    -------
    error : str or None
        Why ``"ours"`` cannot run at all (import failure, backend rejected).
    warning : str or None
        Set when it runs but disagrees with SDPA by more than ``atol`` (a wrong
        kernel's speed is not worth reporting silently).
    """
    try:
        fn = implementation("ours", backend)
        q, k, v = (t[:1, :1, :16] for t in make_inputs(64))
        out = fn(q, k, v)
    except Exception as exc:  # noqa: BLE001 - any failure is reported, not raised
        return f"attn_ext.cross_attention(backend={backend!r}) cannot run: {type(exc).__name__}: {exc}", None
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    err = (out.float() - ref.float()).abs().max().item()
    if not err <= atol:
        return None, f"attn_ext.cross_attention(backend={backend!r}) differs from SDPA by {err:.3g} (> {atol})"
    return None, None


def sdpa_kernel_name() -> str:
    """Which kernel SDPA picks for the benchmark's dtype/shapes, read off its grad_fn."""
    q, k, v = (t[:, :, :64].requires_grad_() for t in make_inputs(64))
    name = type(torch.nn.functional.scaled_dot_product_attention(q, k, v).grad_fn).__name__
    if "FlashAttentionForCpu" in name:
        return "flash (CPU)"
    return f"other ({name})"
