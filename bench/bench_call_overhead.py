"""``python -m bench run call_overhead``: attn_ext's per-call overhead and the small shapes of Neural
Processes, against PyTorch's SDPA (issue 29).

Each row times ``ae.cross_attention(q, k, v)`` (**ours**) and ``torch.nn.functional.scaled_dot_product_attention``
(**SDPA**) on the same fp32 CPU inputs ``q [B,H,M,D]``, ``k, v [B,H,N,D]``, samples interleaved
(:data:`ROWS`):

1. B=H=M=N=1, D=16 under ``torch.no_grad()``: nothing but the cost of a call. The raw op
   ``torch.ops.attn_ext.cross_attention_fwd(q, k, v, None, scale, 512)`` is timed beside them, for
   information, in every no-grad row: the gap between it and ours is the Python wrapper's.
2. The same shape, inputs ``requires_grad=True``, forward only (grad mode on: the graph is recorded).
3. The same shape, forward + ``out.sum().backward()`` (the inputs' ``.grad`` accumulates, for both alike).
4. B=1, H=4, M=128, N=16, D=64, a state update's shape; 5. B=16, H=4, M=128, N=50, D=16, a CMAB cross
   attention in GP training; 6. B=16, H=4, M=128, N=128, D=16, the latent self-attention. Forward under
   ``torch.no_grad()``, at 2 threads and at 1 (:data:`NP_THREADS`).

Rows 1-3 run at PyTorch's default thread count (what a caller gets; a call this small must not wake a
second thread). Before timing, each row's outputs (and, for row 3, the inputs' gradients) are compared
with SDPA's, and ``attn_ext.cross_attention`` is smoke-tested (:func:`bench.harness.calls.check_ours`).

A call of row 1 takes microseconds, far below what one timed call can resolve: every sample is the mean
of ``number`` back-to-back calls, ``number`` chosen per row (:func:`calls_per_sample`) so that a sample of
the fastest implementation lasts at least :data:`SAMPLE_S`. The samples of ours, SDPA and the raw op are
interleaved, the order rotating (:func:`bench.harness.timing.time_interleaved`), so background load
drifting over seconds hits all alike; the report gives medians.

The issue's goals (:data:`GOALS`): no-grad per-call overhead (row 1) <= 2x SDPA; with grad (rows 2, 3)
<= 2x SDPA; the NP shapes (rows 4-6) <= 1.0x SDPA on 1 and 2 threads. A failing or borderline row is
re-measured before it is judged (:func:`bench.harness.goals.confirm`). The quick grid has the same rows
with fewer samples.

Writes ``call_overhead.{md,json,png}`` and prints the Markdown tables to stdout; progress goes to stderr.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

import attn_ext as ae
from bench.harness import BenchOptions
from bench.harness.calls import check_ours
from bench.harness.goals import combined, confirm, confirmed_text
from bench.harness.machine import load_average, machine_info, machine_markdown, timing_footer
from bench.harness.plot import Series, plot_panel
from bench.harness.report import markdown_table, progress, publish_run, timing_dict
from bench.harness.timing import WARMUP_TEXT, gc_frozen, time_interleaved, torch_threads

NAME = "call_overhead"
DTYPE = torch.float32
#: Thread counts of the NP-shape rows (the issue's "1 and 2 threads").
NP_THREADS: tuple[int, ...] = (2, 1)
#: Chunk size passed to the raw op: ``ae.cross_attention``'s default.
RAW_CHUNK = 512
#: Max abs difference of ours to SDPA (fp32, values of order 1) above which the report warns.
CHECK_ATOL = 1e-4


@dataclass(frozen=True)
class Row:
    """One timed row: ``shape`` is ``(B, H, M, N, D)``; ``pass_`` "no_grad", "requires_grad" or "fwd+bwd";
    ``threads`` None = PyTorch's default; ``goal`` the key of :data:`GOALS` judging it."""

    key: str
    label: str
    shape: tuple[int, int, int, int, int]
    pass_: str
    threads: int | None
    goal: str


def make_rows(np_threads: tuple[int, ...] = NP_THREADS) -> list[Row]:
    """The rows of the module docstring, the NP shapes once per count in ``np_threads``."""
    one = (1, 1, 1, 1, 16)
    rows = [Row("overhead", "per-call overhead", one, "no_grad", None, "no_grad_overhead"),
            Row("overhead_requires_grad", "per-call overhead, inputs requiring grad", one, "requires_grad", None,
                "grad_overhead"),
            Row("overhead_fwd_bwd", "per-call overhead, forward + backward", one, "fwd+bwd", None, "grad_overhead")]
    for key, label, shape in (("state_update", "state update's shape", (1, 4, 128, 16, 64)),
                              ("cmab_cross", "CMAB cross attention, GP training", (16, 4, 128, 50, 16)),
                              ("latent_self", "latent self-attention", (16, 4, 128, 128, 16))):
        rows += [Row(key, label, shape, "no_grad", t, "np_shapes") for t in np_threads]
    return rows


ROWS: tuple[Row, ...] = tuple(make_rows())
#: Goal key -> (limit on ours / SDPA, text).
GOALS: dict[str, tuple[float, str]] = {
    "no_grad_overhead": (2.0, "no-grad per-call overhead (B=H=M=N=1, D=16), ours / SDPA <= 2"),
    "grad_overhead": (2.0, "per-call overhead with grad (inputs requiring grad; forward + backward), ours / SDPA <= 2"),
    "np_shapes": (1.0, "NP shapes (state update, CMAB cross attention, latent self-attention), ours / SDPA <= 1.0 "
                       "on 1 and 2 threads"),
}


@dataclass(frozen=True)
class TimingPlan:
    """How every row is timed: at least ``repeats`` samples spread over at least ``min_timed_s`` (all
    implementations together), each the mean of calls lasting at least ``sample_s``, after ``min_warmup_s``."""

    repeats: int
    min_timed_s: float
    sample_s: float
    min_warmup_s: float = 0.5


#: A sample of the fastest implementation lasts at least this long: the ``gc.collect`` before it and the
#: timer's own cost then weigh under a percent, and a ~5 µs call is repeated about 2000 times.
SAMPLE_S = 0.01


def timing_plan(options: BenchOptions) -> TimingPlan:
    """The full grid's plan, or the quick grid's (same rows, fewer samples over a shorter span)."""
    if options.quick:
        return TimingPlan(repeats=max(options.repeats, 7), min_timed_s=0.4, sample_s=SAMPLE_S)
    return TimingPlan(repeats=max(options.repeats, 21), min_timed_s=3.0, sample_s=SAMPLE_S)


def make_inputs(row: Row, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``q, k, v`` of the row's shape, fp32, CPU; leaves requiring grad unless the row is no-grad."""
    b, h, m, n, d = row.shape
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, rows_, d, generator=gen, dtype=DTYPE) for rows_ in (m, n, n))
    return tuple(t.requires_grad_(row.pass_ != "no_grad") for t in (q, k, v))


def implementations(row: Row, backend: str) -> dict[str, Callable]:
    """Name -> ``f(q, k, v)`` returning the output: ours, SDPA, and in no-grad rows the raw op."""
    fns = {"ours": lambda q, k, v: ae.cross_attention(q, k, v, backend=backend),
           "sdpa": torch.nn.functional.scaled_dot_product_attention}
    if row.pass_ == "no_grad":
        scale = 1.0 / math.sqrt(row.shape[-1])
        fns["raw"] = lambda q, k, v: torch.ops.attn_ext.cross_attention_fwd(q, k, v, None, scale, RAW_CHUNK)[0]
    return fns


def make_calls(row: Row, backend: str, q, k, v) -> dict[str, Callable[[], object]]:
    """Zero-argument calls of each implementation for the row's pass (no-grad rows are timed inside
    ``torch.no_grad()`` as a whole, so the context manager is not charged per call)."""
    def call(fn):
        if row.pass_ == "fwd+bwd":
            return lambda: fn(q, k, v).sum().backward()
        return lambda: fn(q, k, v)

    return {name: call(fn) for name, fn in implementations(row, backend).items()}


def check_row(row: Row, backend: str) -> float:
    """Max abs difference to SDPA of ours (and the raw op) on the row's inputs: outputs, and for the
    forward + backward row the gradients of q, k, v too."""
    results = {}
    for name, fn in implementations(row, backend).items():
        q, k, v = make_inputs(row)
        with torch.set_grad_enabled(row.pass_ != "no_grad"):
            out = fn(q, k, v)
        grads = torch.autograd.grad(out.sum(), (q, k, v)) if row.pass_ == "fwd+bwd" else ()
        results[name] = (out.detach(), *grads)
    return max((a - b).abs().max().item() for name, res in results.items() if name != "sdpa"
               for a, b in zip(res, results["sdpa"]))


def calls_per_sample(calls: dict[str, Callable[[], object]], sample_s: float) -> int:
    """Back-to-back calls per sample so that the fastest implementation's sample lasts ``sample_s``. Each
    call's time is the median of single calls over up to 20 ms after three warm ones: on a shared machine
    one call may stall for milliseconds (a second thread waiting for a busy core), and a mean would take
    that stall for the call's cost and make every sample of the row far too short."""
    fastest = math.inf
    for call in calls.values():
        for _ in range(3):
            call()
        times, end = [], time.perf_counter() + min(sample_s, 0.02)
        while len(times) < 5 or (time.perf_counter() < end and len(times) < 1000):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        fastest = min(fastest, statistics.median(times))
    return max(1, math.ceil(sample_s / fastest))


def time_row(row: Row, options: BenchOptions, plan: TimingPlan, scale_repeats: int = 1) -> dict:
    """One row: its implementations' samples interleaved at the row's thread count and grad mode."""
    q, k, v = make_inputs(row)
    calls = make_calls(row, options.backend, q, k, v)
    with torch_threads(row.threads) as threads, torch.set_grad_enabled(row.pass_ != "no_grad"):
        number = calls_per_sample(calls, plan.sample_s)
        # Frozen after the calibration's calls, so that what their first calls imported is frozen too.
        with gc_frozen():
            timed = time_interleaved(calls, repeats=plan.repeats * scale_repeats, number=number,
                                     min_warmup_s=plan.min_warmup_s, min_timed_s=plan.min_timed_s * scale_repeats)
    return {"threads": threads, "number": number, "impls": {n: timing_dict(t) for n, t in timed.items()}}


def ratio(measured: dict, a: str = "ours", b: str = "sdpa") -> float | None:
    """``a``'s median over ``b``'s in a row's measurement; None when either failed or is missing."""
    ta, tb = (measured["impls"].get(i, {}).get("median_ms") for i in (a, b))
    return ta / tb if ta and tb else None


def measure(rows: list[Row], options: BenchOptions, plan: TimingPlan) -> tuple[list[dict], list[str]]:
    """Check, then time every row; returns the row results and the check warnings."""
    results, warnings = [], []
    for i, row in enumerate(rows, 1):
        diff = check_row(row, options.backend)
        if not diff <= CHECK_ATOL:
            warnings.append(f"{row.label} {row.shape}: ours differs from SDPA by {diff:.3g} (> {CHECK_ATOL:g})")
        progress(f"[{i}/{len(rows)}] {row.label}, (B,H,M,N,D)={row.shape}, {row.pass_}, "
                 f"{row.threads or 'default'} thread(s) (check: max abs diff {diff:.2g}) ...", end="")
        measured = time_row(row, options, plan)
        results.append({"index": i - 1, "key": row.key, "label": row.label, "shape": list(row.shape),
                        "pass": row.pass_, "goal": row.goal, "max_abs_diff": diff, **measured})
        progress(f" x{measured['number']} calls per sample: " + ", ".join(
            f"{n} failed: {t['error']}" if t.get("error") else f"{n} {format_us(t['median_ms'])} µs"
            for n, t in measured["impls"].items()))
    return results, warnings


def judge_goals(results: list[dict], remeasure: Callable[[dict], dict] | None) -> dict:
    """Judge every row against its goal's limit (:func:`bench.harness.goals.confirm`, re-measuring a
    failing or borderline row once with ``remeasure(row) -> measurement``); returns goal -> verdict."""
    out = {}
    for goal, (limit, _) in GOALS.items():
        picked = [r for r in results if r["goal"] == goal]
        for r in picked:
            again = None if remeasure is None else (lambda r=r: ratio(remeasure(r)))
            r["judged"] = confirm(ratio(r), limit, False, again,
                                  f"ours / SDPA, {r['label']} at {r['threads']} thread(s)", progress)
        met, verdict = combined([r["judged"] for r in picked])
        out[goal] = {"limit": limit, "met": met, "verdict": verdict, "rows": len(picked),
                     "rows_met": sum(r["judged"]["met"] is True for r in picked)}
    return out


def format_us(ms: float | None) -> str | None:
    """Microseconds for a table cell from milliseconds: 3 significant digits, thousands separated above."""
    if ms is None:
        return None
    return f"{ms * 1e3:.3g}" if ms < 1 else f"{ms * 1e3:,.0f}"


def _x(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}x"


def _shape(r: dict) -> str:
    return "B={}, H={}, M={}, N={}, D={}".format(*r["shape"])


def tables(result: dict) -> str:
    """The Markdown block: what was timed, the table, the goals, the machine."""
    cfg = result["config"]
    body = [[r["label"], _shape(r), r["pass"], r["threads"], format_us(r["impls"]["ours"]["median_ms"]),
             format_us(r["impls"]["sdpa"]["median_ms"]), _x(ratio(r)), f"<= {GOALS[r['goal']][0]:g}",
             confirmed_text(r["judged"], lambda v: f"{v:.2f}x"),
             format_us(r["impls"].get("raw", {}).get("median_ms")) or "—", _x(ratio(r, "raw")) or "—",
             f"{r['number']:,}", f"{r['max_abs_diff']:.1e}"] for r in result["rows"]]
    goals = [f"- Goal: {GOALS[g][1]}: met in {v['rows_met']} of {v['rows']} rows, **{v['verdict']}**."
             for g, v in result["goals"].items()]
    return "\n".join([
        f"`ae.cross_attention(q, k, v, backend=\"{cfg['backend']}\")` (ours) vs "
        "`torch.nn.functional.scaled_dot_product_attention` (SDPA), q `[B,H,M,D]`, k, v `[B,H,N,D]`, fp32, CPU; "
        "**raw op**: `torch.ops.attn_ext.cross_attention_fwd(q, k, v, None, scale, 512)`, for information. "
        "**no_grad**: forward under `torch.no_grad()`; **requires_grad**: inputs requiring grad, forward only; "
        "**fwd+bwd**: forward + `out.sum().backward()`. Times in µs per call: median of at least "
        f"{cfg['repeats']} samples spread over at least {cfg['min_timed_s']:g} s per row, each sample the mean of "
        f"back-to-back calls (their number per row below, so that one sample lasts at least {cfg['sample_s'] * 1e3:g} "
        f"ms), after {WARMUP_TEXT}, the implementations' samples interleaved. Threads: the count the row ran "
        "with (the overhead rows at PyTorch's default). A ratio below 1 = ours faster.",
        "",
        markdown_table(["row", "shape", "pass", "threads", "ours µs", "SDPA µs", "ours / SDPA", "goal", "verdict",
                        "raw op µs", "raw / SDPA", "calls per sample", "max abs diff vs SDPA"],
                       body, align="lllrrrrllrrrr"),
        "",
        *goals,
        "",
        *timing_footer(result["machine"]),
    ])


def summary(result: dict) -> tuple[str, str]:
    """The README's short table (ratio per row) and its sentence with the goals."""
    body = [[r["label"], r["threads"], format_us(r["impls"]["ours"]["median_ms"]),
             format_us(r["impls"]["sdpa"]["median_ms"]), _x(ratio(r)), r["judged"]["verdict"]]
            for r in result["rows"]]
    goals = " ".join(f"{GOALS[g][1][0].upper()}{GOALS[g][1][1:]}: **{v['verdict']}**."
                     for g, v in result["goals"].items())
    return (markdown_table(["row", "threads", "ours µs", "SDPA µs", "ours / SDPA", "verdict"], body),
            f"`ae.cross_attention` ({result['config']['backend']}) vs SDPA per call, fp32, CPU: the per-call overhead "
            f"and the small shapes of Neural Processes (issue 29). {goals}")


def plot(result: dict, path) -> None:
    """Time per call vs the forward's flops (4·B·H·M·N·D), no-grad rows: ours, SDPA and the raw op per thread
    count."""
    rows = [r for r in result["rows"] if r["pass"] == "no_grad"]
    series = []
    for i, threads in enumerate(sorted({r["threads"] for r in rows}, reverse=True)):
        mine = [r for r in rows if r["threads"] == threads]
        xs = [4 * math.prod(r["shape"]) for r in mine]
        for impl, label, marker, color in (("ours", "ours", "o", "C0"), ("sdpa", "SDPA", "s", "k"),
                                           ("raw", "raw op", "^", "C2")):
            ys = [None if (t := r["impls"].get(impl, {}).get("median_ms")) is None else t * 1e3 for r in mine]
            series.append(Series(f"{label}, {threads} thread(s)", xs, ys, "-" if i == 0 else "--", marker, color))
    plot_panel(series, path, title="cross attention per call vs SDPA, fp32, no grad",
               xlabel="forward flops (4·B·H·M·N·D)",
               ylabel="time per call (µs, median)")


def run(options: BenchOptions) -> int:
    """Run the benchmark (module docstring). Exit status 0 whether or not the goals are met (the report
    says); 2 when attn_ext's op cannot run with the backend; 1 when a measurement failed or the README
    could not be updated."""
    error, warning = check_ours(options.backend)
    if error:
        progress(f"error: {error}")
        return 2
    warnings = [warning] if warning else []
    plan, rows, machine = timing_plan(options), list(ROWS), machine_info()
    progress(f"{NAME} benchmark ({options.grid} grid): {len(rows)} rows, backend={options.backend}; "
             f"{machine_markdown(machine)}")
    results, check_warnings = measure(rows, options, plan)
    # Twice the samples over twice the span: a re-measurement should settle what the first left in doubt.
    goals = judge_goals(results, lambda r: time_row(rows[r["index"]], options, plan, scale_repeats=2))
    machine["load_average_end"] = load_average()
    result = {"benchmark": NAME, "grid": options.grid, "command": options.command,
              "config": {"dtype": "fp32", "device": "cpu", "backend": options.backend, "quick": options.quick,
                         "repeats": plan.repeats, "min_timed_s": plan.min_timed_s, "sample_s": plan.sample_s,
                         "raw_chunk_size": RAW_CHUNK, "np_threads": list(NP_THREADS)},
              "machine": machine, "rows": results, "goals": goals, "warnings": warnings + check_warnings}
    failed = [f"{r['label']} at {r['threads']} thread(s), {n} failed: {t['error']}" for r in results
              for n, t in r["impls"].items() if t.get("error")]
    return publish_run(NAME, result, tables, summary, options, plot, failed)


# ------------------------------------------------------------------------------ pytest-benchmark
# Defined only under pytest (bench/conftest.py collects bench_*.py), so `python -m bench` needs no pytest.
if "pytest" in sys.modules:
    import pytest

    @pytest.mark.parametrize("impl", ["ours", "sdpa", "raw"])
    @pytest.mark.parametrize("row", [r for r in ROWS if r.threads in (None, 1)], ids=lambda r: f"{r.key}-{r.pass_}")
    def test_call_overhead(benchmark, request: pytest.FixtureRequest, row: Row, impl: str, backend: str):
        if impl != "sdpa" and (error := check_ours(backend)[0]):
            pytest.skip(error)
        calls = make_calls(row, backend, *make_inputs(row))
        if impl not in calls:
            pytest.skip(f"the raw op is timed in no-grad rows only, not {row.pass_}")
        benchmark.group = f"call_overhead {row.key} {row.pass_}"
        benchmark.extra_info.update(shape=str(row.shape), impl=impl, backend=backend)
        with torch_threads(row.threads), torch.set_grad_enabled(row.pass_ != "no_grad"):
            benchmark.pedantic(calls[impl], rounds=request.config.getoption("--bench-rounds"), warmup_rounds=1,
                               iterations=calls_per_sample(calls, 0.002))
