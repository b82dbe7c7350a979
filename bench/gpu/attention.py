"""GPU benchmark: attention forward and forward+backward, attn_ext's ``cuda`` and ``triton`` backends against
SDPA's flash, cuDNN and memory-efficient kernels and FlexAttention, in the same process
(:mod:`bench.gpu.attention_impls`).

Grid: fp16 and bf16; B = 8, H = 16; D = Dv in {64, 128}; self-attention shapes M = N in {1024, 4096, 16384};
causal and not; default scale, contiguous ``[B, H, N, D]`` inputs. TFLOP/s counts the flops of the CPU
benchmark (``bench.bench_cross_attention.FLOP_FACTOR``): 4·B·H·M·N·D forward (QKᵀ and PV), 14·B·H·M·N·D
forward+backward (the backward recomputes QKᵀ and does four more products), causal rows half of that (the
convention of FlashAttention's papers). Inputs smaller than :data:`MIN_BYTES` (several times the H200's
60 MB L2) come in several copies used in turn, so that no timed call finds its inputs in the L2.

Before an implementation is timed on a case, its result is checked against SDPA's flash kernel: the output
(forward) or the three gradients (forward+backward) must be finite and within a relative Frobenius error of
:data:`TOLERANCE` of SDPA's (twice that for gradients). SDPA and ours both accumulate in fp32 and round
P to the input dtype before PV, each with its own rounding, so the bound is a few units of the dtype's
rounding: loose enough for that, far below what a broken kernel gives (NaN, zeros, order-1 errors). The
exact accuracy rule (FlashAttention's, against fp64) is the tests stage's, on smaller shapes. A failed
check raises :class:`bench.gpu.checks.WrongResult`; an implementation that refuses a case (an SDPA backend
this card or build lacks) gives the row a note with its error instead.

Order (:mod:`bench.gpu.plan`): the goal rows first (:func:`priority`: bf16, D = 128, L = S in {4096, 16384},
causal and not, where attn_ext's goals against SDPA's flash kernel are measured), then the rest of bf16,
then fp16. Within a case SDPA's flash kernel runs first (the reference), then cuDNN, ours, and last the
memory-efficient kernel and FlexAttention (whose compile per shape is the slowest step), so that a run
stopped mid-case has the goal's columns. A call predicted, or found, slower than the budget's limit per
call (:class:`bench.gpu.timing.Budget`: the ``cuda`` backend at 16k tokens) is left with the reason.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable

import torch

from bench.bench_cross_attention import FLOP_FACTOR
from bench.gpu.attention_impls import FLEX_DTYPES, IMPLS, REFERENCE, implementation, unavailable
from bench.gpu.checks import require_close
from bench.gpu.timing import TIME_LIMIT_NOTE, Budget, TooSlow, cuda_time
from bench.harness.report import markdown_table

NAME = "attention"
#: The order implementations run in within a case (the tables keep IMPLS's order; see the module docstring).
RUN_ORDER = (REFERENCE, "sdpa-cudnn", "triton", "cuda", "sdpa-efficient", "flex", "triton-tma")
B, H = 8, 16
HEAD_DIMS = (64, 128)
NS = (1024, 4096, 16384)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
PASSES = ("fwd", "fwd+bwd")
#: Inputs below this many bytes (q, k, v, grad_out of one copy) are replicated: 4x the H200's 60 MB L2.
MIN_BYTES = 4 * 60 * 2**20
#: Largest relative Frobenius error of the output against SDPA's flash kernel, per dtype (eps: fp16 9.8e-4,
#: bf16 7.8e-3); gradients may have GRAD_FACTOR times more (the backward adds three products' rounding).
TOLERANCE = {"fp16": 1e-2, "bf16": 4e-2}
GRAD_FACTOR = 2.0
#: The rows attn_ext's attention goals are measured on (priority 0; see the module docstring).
GOAL_DTYPE, GOAL_D, GOAL_NS = "bf16", 128, (4096, 16384)


@dataclass(frozen=True)
class Case:
    dtype: str
    d: int
    n: int
    causal: bool = False

    @property
    def label(self) -> str:
        return f"{self.dtype} D={self.d} N={self.n}{' causal' if self.causal else ''}"


def cases() -> list[Case]:
    """The grid, smallest problems first (fp16 before bf16), each size full before causal: the tables' order;
    :func:`priority` gives the order of the run."""
    return [Case(dtype, d, n, causal) for dtype in DTYPES for d in HEAD_DIMS for n in NS for causal in (False, True)]


def priority(case: Case) -> int:
    """0: a goal row; 1: the rest of bf16; 2: fp16 (:mod:`bench.gpu.plan` runs the lower first)."""
    if case.dtype == GOAL_DTYPE:
        return 0 if case.d == GOAL_D and case.n in GOAL_NS else 1
    return 2


def attention_flops(b: int, h: int, m: int, n: int, d: int, pass_: str, causal: bool = False) -> float:
    """Flops of one call of ``pass_`` (see the module docstring; D = Dv); causal calls count half."""
    return FLOP_FACTOR[pass_] * b * h * m * n * d * (0.5 if causal else 1)


def tflops(flops: int, ms: float | None) -> float | None:
    return None if not ms else flops / (ms * 1e-3) / 1e12


def make_inputs(case: Case, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """Copies of ``q, k, v, grad_out``: standard normal ``[B, H, N, D]`` on the GPU (M = N), as many as make
    :data:`MIN_BYTES` (one for the large cases)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    one = 4 * B * H * case.n * case.d * torch.empty((), dtype=DTYPES[case.dtype]).element_size()
    copies = max(1, -(-MIN_BYTES // one))
    return [tuple(torch.randn(B, H, case.n, case.d, device="cuda", dtype=DTYPES[case.dtype], generator=gen)
                  for _ in range(4)) for _ in range(copies)]


def pass_call(fn: Callable, pass_: str, inputs: list[tuple[torch.Tensor, ...]], causal: bool) -> Callable[[], object]:
    """Zero-argument call of ``pass_``, each call on the next copy of the inputs; fwd+bwd takes the gradients
    of q, k, v for ``grad_out``."""
    if pass_ == "fwd":
        turn = itertools.cycle([(q, k, v) for q, k, v, _ in inputs])
        return lambda: fn(*next(turn), causal)
    leaves = [([t.detach().requires_grad_(True) for t in (q, k, v)], g) for q, k, v, g in inputs]
    turn = itertools.cycle(leaves)

    def call():
        xs, grad_out = next(turn)
        return torch.autograd.grad(fn(*xs, causal), xs, grad_out)

    return call


def check(label: str, outputs, references, dtype: str) -> float:
    """The largest relative error of the output, or of each gradient, against SDPA's; raises
    :class:`~bench.gpu.checks.WrongResult` above the bound of :data:`TOLERANCE`."""
    if isinstance(outputs, torch.Tensor):
        return require_close(f"{label} vs SDPA flash ({dtype})", {"out": (outputs, references)}, TOLERANCE[dtype])
    pairs = {name: pair for name, pair in zip(("dq", "dk", "dv"), zip(outputs, references))}
    return require_close(f"{label} vs SDPA flash ({dtype})", pairs, TOLERANCE[dtype] * GRAD_FACTOR)


def _row(case: Case, pass_: str, impl: str, flops: float) -> dict:
    return {"section": NAME, "dtype": case.dtype, "D": case.d, "N": case.n, "M": case.n, "causal": case.causal,
            "pass": pass_, "impl": impl, "flops": flops}


def measure(case: Case, budget: Budget, progress: Callable[[str], None]) -> list[dict]:
    """Rows of one case: every (pass, impl) in :data:`RUN_ORDER`, SDPA's flash kernel first (the reference).
    A row starts only before the budget's deadline and when its call is not predicted over the budget's
    limit per call from an earlier row (:meth:`~bench.gpu.timing.Budget.too_slow`); a call found over it is
    checked but not sampled."""
    if budget.expired():  # no inputs, no reference: a case past the deadline costs nothing
        return [{**_row(case, pass_, impl, attention_flops(B, H, case.n, case.n, case.d, pass_, case.causal)),
                 "note": TIME_LIMIT_NOTE} for pass_ in PASSES for impl in RUN_ORDER]
    inputs = make_inputs(case)
    q = inputs[0][0]
    rows = []
    for pass_ in PASSES:
        flops = attention_flops(B, H, case.n, case.n, case.d, pass_, case.causal)
        reference = pass_call(implementation(REFERENCE), pass_, inputs[:1], case.causal)()
        sdpa_ms = None
        for impl in RUN_ORDER:
            row = _row(case, pass_, impl, flops)
            rate_key = (impl, case.dtype, case.d, case.causal, pass_)
            reason = unavailable(impl, q) or budget.too_slow(rate_key, flops)
            if reason or budget.expired():
                rows.append({**row, "note": f"not measured: {reason}" if reason else TIME_LIMIT_NOTE})
                progress(f"{case.label} {pass_:7s} {impl:14s} {rows[-1]['note']}")
                continue
            started = time.monotonic()
            try:
                first = pass_call(implementation(impl), pass_, inputs[:1], case.causal)()
            except (RuntimeError, NotImplementedError) as exc:  # an SDPA backend this card or build lacks
                rows.append({**row, "note": f"not measured: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"})
                continue
            # Seconds of the first call: its compiles (FlexAttention), its autotuning (Triton), its first launch.
            row["first_call_s"] = round(time.monotonic() - started, 2)
            row["rel_err"] = check(f"{impl} {pass_} {case.label}", first, reference, case.dtype)
            del first
            try:
                timing = cuda_time(pass_call(implementation(impl), pass_, inputs, case.causal),
                                   max_call_s=budget.max_call_s)
            except TooSlow as exc:
                budget.record(rate_key, flops, exc.seconds * 1e3, case.label)
                spent = _seconds(row, started)
                rows.append({**row, "call_s": exc.seconds, "note": f"not measured: {exc} (its result was checked)"})
                progress(f"{case.label} {pass_:7s} {impl:14s} {exc} [{spent}]")
                continue
            budget.record(rate_key, flops, timing.median_ms, case.label)
            sdpa_ms = timing.median_ms if impl == REFERENCE else sdpa_ms
            row.update(ms=timing.median_ms, samples_ms=list(timing.samples_ms), peak_mib=timing.peak_mib,
                       tflops=tflops(flops, timing.median_ms),
                       vs_sdpa=None if not sdpa_ms else sdpa_ms / timing.median_ms)
            spent = _seconds(row, started)
            progress(f"{case.label} {pass_:7s} {impl:14s} {timing.median_ms:9.3f} ms {row['tflops']:7.1f} TFLOP/s "
                     f"peak {timing.peak_mib:8.1f} MiB (rel. err {row['rel_err']:.1e}) [{spent}]")
            rows.append(row)
        del reference
    return rows


def _seconds(row: dict, started: float) -> str:
    """Where a row's time went, for the log: its first call (compiles, tuning) and all of it."""
    row["row_s"] = round(time.monotonic() - started, 2)
    return f"first call {row['first_call_s']:.1f} s, row {row['row_s']:.1f} s"


def triton_work(case: Case) -> None:
    """Every Triton call :func:`measure` makes for ``case`` (for :mod:`bench.gpu.warm`)."""
    inputs = make_inputs(case)[:1]
    for pass_ in PASSES:
        pass_call(implementation("triton"), pass_, inputs, case.causal)()


#: Tokens of the stand-in that compiles a case's Triton kernels (:func:`warm_case`).
WARM_N = 256


def warm_case(case: Case) -> Case:
    """The smallest case whose Triton calls compile what ``case``'s compile (for :mod:`bench.gpu.warm`).

    Compiling depends on the dtype, D, the causal rule and the integers' specialisations (a multiple of 16,
    1, 32-bit), not on the sizes: every M = N >= 128 keeps every tile config (the size buckets prune none),
    and at B = 8, H = 16 every stride and size is a multiple of 16 for every N of the grid, so N = 256 compiles
    the kernels of N = 1024, 4096 and 16384 (the same 46-49 compiles each, recorded for sm_90 with
    bench/gpu/triton_aot_capture.py: bench/tests/test_gpu_warm_compiles.py), with launches of microseconds
    instead of up to a second per config."""
    return Case(case.dtype, case.d, WARM_N, case.causal)


def has_flex(case: Case) -> bool:
    """Whether :func:`measure` runs FlexAttention on ``case`` (bf16 only, see attention_impls.FLEX_DTYPES)."""
    return DTYPES[case.dtype] in FLEX_DTYPES


def flex_work(case: Case) -> None:
    """The FlexAttention calls :func:`measure` makes for ``case``, once each (for :mod:`bench.gpu.warm`): their
    compiles land in Inductor's caches on disk, where the timing process finds them (FlexAttention compiles
    per shape, so this runs the case's own shape)."""
    inputs = make_inputs(case)[:1]
    for pass_ in PASSES:
        pass_call(implementation("flex"), pass_, inputs, case.causal)()


def _fmt(x, spec: str) -> str | None:
    return None if x is None else format(x, spec)


def markdown(rows: list[dict]) -> str:
    """One table: a line per (dtype, D, N, mask, pass) in the grid's order (:func:`cases`, whatever the order
    of the run), the implementations side by side in :data:`IMPLS`'s order."""
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_key.setdefault((r["dtype"], r["D"], r["N"], r.get("causal", False), r["pass"]), {})[r["impl"]] = r
    dtypes = list(DTYPES)
    by_key = dict(sorted(by_key.items(),
                         key=lambda kv: (dtypes.index(kv[0][0]), *kv[0][1:4], PASSES.index(kv[0][4]))))
    others = [i for i in IMPLS if i != REFERENCE]
    header = ["dtype", "D", "N = M", "mask", "pass", *(f"{i} TFLOP/s" for i in IMPLS),
              *(f"{i} / flash" for i in others), f"peak MiB ({' / '.join(IMPLS)})"]
    body, notes = [], []
    for (dtype, d, n, causal, pass_), impls in by_key.items():
        mask = "causal" if causal else "none"
        body.append([dtype, d, f"{n:,}", mask, pass_, *(_fmt(impls.get(i, {}).get("tflops"), ".1f") for i in IMPLS),
                     *(_fmt(impls.get(i, {}).get("vs_sdpa"), ".2f") for i in others),
                     " / ".join(_fmt(impls.get(i, {}).get("peak_mib"), ".0f") or "n/a" for i in IMPLS)])
        notes += [f"{i} {dtype} D={d} N={n:,} {mask} {pass_}: {impls[i]['note']}" for i in IMPLS
                  if impls.get(i, {}).get("note")]
    intro = (f"Attention, B={B}, H={H}, M = N (self-attention shapes), D = Dv, no mask or causal, contiguous inputs. "
             "TFLOP/s: 4·B·H·M·N·D flops forward, 14·B·H·M·N·D forward+backward (causal: half), over the median "
             "time (CUDA events). **/ flash**: the time of SDPA restricted to its flash kernel over this "
             "implementation's (above 1: faster than flash). Ours is `ae.scaled_dot_product_attention`; Flex is "
             "FlexAttention compiled once. "
             "Peak MiB: the most memory allocated during the call above what was allocated before it (inputs "
             "excluded). Every timed call was first checked against SDPA: relative error of the output below "
             f"{', '.join(f'{k} {v:.0e}' for k, v in TOLERANCE.items())}, of each gradient below {GRAD_FACTOR:g}x that.")
    return "\n".join([intro, "", markdown_table(header, body, align="llrll" + "r" * (len(header) - 5))]
                     + (["", "Not measured:", *[f"- {n}" for n in notes]] if notes else []))
