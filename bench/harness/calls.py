"""What the op benchmarks share around their calls: the passes (forward, forward+backward), the smoke
test of attn_ext before minutes of timing, and the common start of a benchmark's ``run``."""

from __future__ import annotations

import importlib
from typing import Callable

import torch

from bench.harness.machine import machine_info, machine_markdown
from bench.harness.report import progress

#: ``"fwd"``: inputs without ``requires_grad``; ``"fwd+bwd"``: forward, then
#: ``torch.autograd.grad(out, (q, k, v), grad_out)`` with a fixed random ``grad_out``.
PASSES: tuple[str, ...] = ("fwd", "fwd+bwd")

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def make_call(fn: Attention, pass_: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], object]:
    """Zero-argument callable running ``pass_`` of ``fn(q, k, v)`` on the given inputs.

    For ``"fwd+bwd"`` the inputs are switched to ``requires_grad`` in place (they are leaves) and a
    fixed ``grad_out`` is drawn once, so every repeat does identical work. ``autograd.grad`` is used
    instead of ``.backward()`` so no ``.grad`` accumulates across repeats.
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


def check_ours(backend: str, atol: float = 1e-4) -> tuple[str | None, str | None]:
    """Smoke-test ``attn_ext.cross_attention(backend=backend)`` on a small problem before spending
    minutes timing it.

    Returns
    -------
    error : str or None
        Why it cannot run at all (import failure, backend rejected with attn_ext's reasons).
    warning : str or None
        Set when it runs but disagrees with SDPA by more than ``atol`` (a wrong kernel's speed is not
        worth reporting silently).
    """
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, m, 64, generator=gen) for m in (16, 64, 64))
    try:
        # Looked up at call time so a stand-in assigned to attn_ext.cross_attention is used.
        out = importlib.import_module("attn_ext").cross_attention(q, k, v, backend=backend)
    except Exception as exc:  # noqa: BLE001 - any failure is reported, not raised
        return f"attn_ext.cross_attention(backend={backend!r}) cannot run: {type(exc).__name__}: {exc}", None
    err = (out.float() - torch.nn.functional.scaled_dot_product_attention(q, k, v)).abs().max().item()
    if not err <= atol:
        return None, f"attn_ext.cross_attention(backend={backend!r}) differs from SDPA by {err:.3g} (> {atol})"
    return None, None


def start_run(name: str, options, quick_ns, full_ns):
    """Common start of a benchmark's ``run``: smoke-test the op, announce the sizes.

    Returns ``(ns, machine, warnings)``, or an exit status (2) when the op cannot run with the backend.
    """
    error, warning = check_ours(options.backend)
    if error:
        progress(f"error: {error}")
        return 2
    if warning:
        progress(f"warning: {warning}")
    ns = quick_ns if options.quick else full_ns
    machine = machine_info()
    progress(f"{name} benchmark ({options.grid} grid): N in {list(ns)}, backend={options.backend}; "
             f"{machine_markdown(machine)}")
    return ns, machine, [warning] if warning else []
