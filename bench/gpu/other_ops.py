"""GPU benchmark: Intention and the batched Cholesky, against their PyTorch counterparts.

**Intention** (B=8, H=4, M = N = 4096, D = Dv = 64, fp32; ridge regression from keys to values, primal
form): ``ae.intention`` and ``ae.sigma_intention`` per backend (cuda, triton), forward and forward+backward,
against SDPA on the same shapes (the CPU benchmark's comparison), each checked first: Intention against
attn_ext's fp64 ``reference`` backend, SDPA needs no check.

**Cholesky**: ``torch.ops.attn_ext.batched_cholesky`` + ``batched_cholesky_solve`` of ``[4096, 64, 64]``
SPD matrices (the CPU benchmark's main size) against ``torch.linalg.cholesky`` + ``torch.cholesky_solve``,
checked against torch's result first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import attn_ext as ae
from bench.gpu.checks import require_close
from bench.gpu.timing import TIME_LIMIT_NOTE, Budget, cuda_time
from bench.harness.report import format_ms, markdown_table

NAME = "other"
INTENTION_SHAPE = (8, 4, 4096, 64)  # B, H, M = N, D = Dv
CHOLESKY_SHAPE = (4096, 64, 64)
FP32_TOLERANCE = 1e-4
INTENTION_TOLERANCE = 1e-3  # a D x D solve per head, conditioned like KᵀK + αI


@dataclass(frozen=True)
class Case:
    what: str  # "intention", "sigma_intention", "sdpa", "cholesky"
    impl: str

    @property
    def label(self) -> str:
        return f"{self.what} {self.impl}"


def cases() -> list[Case]:
    return ([Case(op, b) for op in ("intention", "sigma_intention") for b in ("cuda", "triton")]
            + [Case("sdpa", "torch"), Case("cholesky", "cuda"), Case("cholesky", "torch")])


def _intention_inputs(seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(INTENTION_SHAPE, device="cuda", generator=gen) for _ in range(4))


def _attention_fn(case: Case) -> Callable:
    if case.what == "sdpa":
        return torch.nn.functional.scaled_dot_product_attention
    op = getattr(ae, case.what)
    return lambda q, k, v, backend=case.impl: op(q, k, v, alpha=1.0, backend=backend)


def _cholesky_problem(seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    z = torch.randn(CHOLESKY_SHAPE, device="cuda", generator=gen)
    n = CHOLESKY_SHAPE[-1]
    return z @ z.mT / n + torch.eye(n, device="cuda"), torch.randn(CHOLESKY_SHAPE, device="cuda", generator=gen)


def _cholesky_call(impl: str, a, b) -> Callable[[], torch.Tensor]:
    if impl == "torch":
        return lambda: torch.cholesky_solve(b, torch.linalg.cholesky(a))
    ops = torch.ops.attn_ext
    return lambda: ops.batched_cholesky_solve(ops.batched_cholesky(a)[0], b)


def _unavailable(case: Case) -> str | None:
    if case.impl == "torch":
        return None

    op = "batched_cholesky" if case.what == "cholesky" else case.what
    return ae.available_backends(torch.zeros(1, device="cuda"), op)[case.impl]


def measure(case: Case, budget: Budget, progress: Callable[[str], None]) -> list[dict]:
    row = {"section": NAME, "what": case.what, "impl": case.impl}
    reason = _unavailable(case)
    if reason or budget.expired():
        return [{**row, "note": f"not measured: {reason}" if reason else TIME_LIMIT_NOTE}]
    if case.what == "cholesky":
        a, b = _cholesky_problem()
        call = _cholesky_call(case.impl, a, b)
        row["rel_err"] = require_close(f"{case.label} vs torch", {"x": (call(), _cholesky_call("torch", a, b)())},
                                       FP32_TOLERANCE)
        t = cuda_time(call)
        row.update(ms=t.median_ms, peak_mib=t.peak_mib)
        progress(f"{case.label}: {t.median_ms:.3f} ms")
        return [row]
    q, k, v, grad = _intention_inputs()
    fn = _attention_fn(case)
    if case.what != "sdpa":
        ref = _attention_fn(Case(case.what, "reference"))(q.double(), k.double(), v.double())
        row["rel_err"] = require_close(f"{case.label} vs fp64 reference", {"out": (fn(q, k, v), ref)},
                                       INTENTION_TOLERANCE)
        del ref
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    fwd = cuda_time(lambda: fn(q, k, v))
    bwd = cuda_time(lambda: torch.autograd.grad(fn(*leaves), leaves, grad))
    row.update(fwd_ms=fwd.median_ms, fwd_bwd_ms=bwd.median_ms, peak_mib=bwd.peak_mib)
    progress(f"{case.label}: fwd {fwd.median_ms:.3f} ms, fwd+bwd {bwd.median_ms:.3f} ms")
    return [row]


def triton_work(case: Case) -> None:
    """Every Triton call :func:`measure` makes for ``case`` (for :mod:`bench.gpu.warm`)."""
    if case.impl != "triton":
        return
    q, k, v, grad = _intention_inputs()
    fn = _attention_fn(case)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    fn(q, k, v)
    torch.autograd.grad(fn(*leaves), leaves, grad)


def markdown(rows: list[dict]) -> str:
    attention = [[r["what"], r["impl"], format_ms(r["fwd_ms"]), format_ms(r["fwd_bwd_ms"]), f"{r['peak_mib']:.0f}"]
                 for r in rows if "fwd_ms" in r]
    cholesky = [[r["impl"], format_ms(r["ms"]), f"{r['peak_mib']:.0f}"] for r in rows if r["what"] == "cholesky" and "ms" in r]
    B, H, N, D = INTENTION_SHAPE
    lines = [f"Intention and σIntention (B={B}, H={H}, M = N = {N}, D = Dv = {D}, fp32, α = 1) vs SDPA on the same "
             "shapes; checked against the fp64 reference backend first (relative error below "
             f"{INTENTION_TOLERANCE:.0e}). Peak MiB: forward+backward.", "",
             markdown_table(["op", "backend", "fwd ms", "fwd+bwd ms", "peak MiB"], attention, align="llrrr"), "",
             f"Batched Cholesky factorisation + solve of `{list(CHOLESKY_SHAPE)}` SPD matrices (fp32) vs "
             "`torch.linalg.cholesky` + `torch.cholesky_solve`, checked against torch's result first.", "",
             markdown_table(["implementation", "ms", "peak MiB"], cholesky, align="lrr")]
    notes = [f"- {r['what']} {r['impl']}: {r['note']}" for r in rows if r.get("note")]
    return "\n".join(lines + (["", "Not measured:", *notes] if notes else []))
