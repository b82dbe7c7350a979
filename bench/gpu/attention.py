"""GPU benchmark: cross attention forward and forward+backward, ``backend="cuda"`` and ``backend="triton"``,
against ``scaled_dot_product_attention`` restricted to its flash kernel, in the same process.

Grid: fp16 and bf16; B = 8, H = 16; D = Dv in {64, 128}; self-attention shapes M = N in {1024, 4096, 16384};
no mask, default scale, contiguous ``[B, H, N, D]`` inputs. TFLOP/s counts the flops of the CPU benchmark
(``bench.bench_cross_attention.FLOP_FACTOR``): 4·B·H·M·N·D forward (QKᵀ and PV), 14·B·H·M·N·D
forward+backward (the backward recomputes QKᵀ and does four more products), no causal halving.

Before an implementation is timed on a case, its result is checked against SDPA's: the output (forward)
or the three gradients (forward+backward) must be finite and within a relative Frobenius error of
:data:`TOLERANCE` of SDPA's (twice that for gradients). SDPA and ours both accumulate in fp32 and round
P to the input dtype before PV, each with its own rounding, so the bound is a few units of the dtype's
rounding: loose enough for that, far below what a broken kernel gives (NaN, zeros, order-1 errors). The
exact accuracy rule (FlashAttention's, against fp64) is the tests stage's, on smaller shapes. A failed
check raises :class:`bench.gpu.checks.WrongResult`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from bench.bench_cross_attention import FLOP_FACTOR
from bench.gpu.checks import require_close
from bench.gpu.timing import cuda_time
from bench.harness.report import markdown_table

NAME = "attention"
B, H = 8, 16
HEAD_DIMS = (64, 128)
NS = (1024, 4096, 16384)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
IMPLS = ("sdpa-flash", "cuda", "triton")
PASSES = ("fwd", "fwd+bwd")
#: Largest relative Frobenius error of the output against SDPA's flash kernel, per dtype (eps: fp16 9.8e-4,
#: bf16 7.8e-3); gradients may have GRAD_FACTOR times more (the backward adds three products' rounding).
TOLERANCE = {"fp16": 1e-2, "bf16": 4e-2}
GRAD_FACTOR = 2.0


@dataclass(frozen=True)
class Case:
    dtype: str
    d: int
    n: int

    @property
    def label(self) -> str:
        return f"{self.dtype} D={self.d} N={self.n}"


def cases() -> list[Case]:
    """The grid, smallest problems first (fp16 before bf16)."""
    return [Case(dtype, d, n) for dtype in DTYPES for d in HEAD_DIMS for n in NS]


def attention_flops(b: int, h: int, m: int, n: int, d: int, pass_: str) -> int:
    """Flops of one call of ``pass_`` (see the module docstring; D = Dv)."""
    return FLOP_FACTOR[pass_] * b * h * m * n * d


def tflops(flops: int, ms: float | None) -> float | None:
    return None if not ms else flops / (ms * 1e-3) / 1e12


def make_inputs(case: Case, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``q, k, v, grad_out``: standard normal ``[B, H, N, D]`` on the GPU (M = N)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(B, H, case.n, case.d, device="cuda", dtype=DTYPES[case.dtype], generator=gen)
                 for _ in range(4))


def sdpa_flash(q, k, v):
    """SDPA allowed only its flash kernel: raises rather than falling back to another kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def implementation(impl: str) -> Callable:
    if impl == "sdpa-flash":
        return sdpa_flash
    import attn_ext as ae

    return lambda q, k, v: ae.cross_attention(q, k, v, backend=impl)


def unavailable(impl: str, q: torch.Tensor) -> str | None:
    if impl == "sdpa-flash":
        return None
    import attn_ext as ae

    return ae.available_backends(q)[impl]


def pass_call(fn: Callable, pass_: str, q, k, v, grad_out) -> Callable[[], object]:
    """Zero-argument call of ``pass_``; fwd+bwd takes the gradients of q, k, v for ``grad_out``."""
    if pass_ == "fwd":
        return lambda: fn(q, k, v)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    return lambda: torch.autograd.grad(fn(*leaves), leaves, grad_out)


def check(label: str, outputs, references, dtype: str) -> float:
    """The largest relative error of the output, or of each gradient, against SDPA's; raises
    :class:`~bench.gpu.checks.WrongResult` above the bound of :data:`TOLERANCE`."""
    if isinstance(outputs, torch.Tensor):
        return require_close(f"{label} vs SDPA flash ({dtype})", {"out": (outputs, references)}, TOLERANCE[dtype])
    pairs = {name: pair for name, pair in zip(("dq", "dk", "dv"), zip(outputs, references))}
    return require_close(f"{label} vs SDPA flash ({dtype})", pairs, TOLERANCE[dtype] * GRAD_FACTOR)


def measure(case: Case, deadline: float, progress: Callable[[str], None]) -> list[dict]:
    """Rows of one case: every (pass, impl), SDPA first (it is the reference)."""
    q, k, v, grad_out = make_inputs(case)
    rows = []
    for pass_ in PASSES:
        flops = attention_flops(B, H, case.n, case.n, case.d, pass_)
        reference = pass_call(sdpa_flash, pass_, q, k, v, grad_out)()
        sdpa_ms = None
        for impl in IMPLS:
            row = {"section": NAME, "dtype": case.dtype, "D": case.d, "N": case.n, "M": case.n, "pass": pass_,
                   "impl": impl, "flops": flops}
            reason = unavailable(impl, q)
            if reason or time.monotonic() > deadline:
                rows.append({**row, "note": f"not measured: {reason or 'time limit of the bench stage'}"})
                continue
            call = pass_call(implementation(impl), pass_, q, k, v, grad_out)
            row["rel_err"] = check(f"{impl} {pass_} {case.label}", call(), reference, case.dtype)
            timing = cuda_time(call)
            sdpa_ms = timing.median_ms if impl == "sdpa-flash" else sdpa_ms
            row.update(ms=timing.median_ms, samples_ms=list(timing.samples_ms), peak_mib=timing.peak_mib,
                       tflops=tflops(flops, timing.median_ms),
                       vs_sdpa=None if not sdpa_ms else sdpa_ms / timing.median_ms)
            progress(f"{case.label} {pass_:7s} {impl:10s} {timing.median_ms:9.3f} ms {row['tflops']:7.1f} TFLOP/s "
                     f"peak {timing.peak_mib:8.1f} MiB (rel. err {row['rel_err']:.1e})")
            rows.append(row)
        del reference
    return rows


def triton_work(case: Case) -> None:
    """Every Triton call :func:`measure` makes for ``case`` (for :mod:`bench.gpu.warm`)."""
    q, k, v, grad_out = make_inputs(case)
    for pass_ in PASSES:
        pass_call(implementation("triton"), pass_, q, k, v, grad_out)()


def _fmt(x, spec: str) -> str | None:
    return None if x is None else format(x, spec)


def markdown(rows: list[dict]) -> str:
    """One table: a line per (dtype, D, N, pass), the implementations side by side."""
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_key.setdefault((r["dtype"], r["D"], r["N"], r["pass"]), {})[r["impl"]] = r
    header = ["dtype", "D", "N = M", "pass", *(f"{i} TFLOP/s" for i in IMPLS), *(f"{i} / SDPA" for i in IMPLS[1:]),
              f"peak MiB ({' / '.join(IMPLS)})"]
    body, notes = [], []
    for (dtype, d, n, pass_), impls in by_key.items():
        body.append([dtype, d, f"{n:,}", pass_, *(_fmt(impls.get(i, {}).get("tflops"), ".1f") for i in IMPLS),
                     *(_fmt(impls.get(i, {}).get("vs_sdpa"), ".2f") for i in IMPLS[1:]),
                     " / ".join(_fmt(impls.get(i, {}).get("peak_mib"), ".0f") or "n/a" for i in IMPLS)])
        notes += [f"{i} {dtype} D={d} N={n:,} {pass_}: {r['note']}" for i, r in impls.items() if r.get("note")]
    intro = (f"Cross attention, B={B}, H={H}, M = N (self-attention shapes), D = Dv, no mask, contiguous inputs. "
             "TFLOP/s: 4·B·H·M·N·D flops forward, 14·B·H·M·N·D forward+backward, over the median time (CUDA events). "
             "**/ SDPA**: SDPA's time over ours (above 1: ours is faster). SDPA is restricted to its flash kernel. "
             "Peak MiB: the most memory allocated during the call above what was allocated before it (inputs "
             "excluded). Every timed call was first checked against SDPA: relative error of the output below "
             f"{', '.join(f'{k} {v:.0e}' for k, v in TOLERANCE.items())}, of each gradient below {GRAD_FACTOR:g}x that.")
    return "\n".join([intro, "", markdown_table(header, body, align="llrl" + "r" * (len(header) - 4))]
                     + (["", "Not measured:", *[f"- {n}" for n in notes]] if notes else []))
