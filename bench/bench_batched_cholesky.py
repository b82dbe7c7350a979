"""``python -m bench run batched_cholesky``: the batched Cholesky ops vs ``torch.linalg`` (docs/spec.md §4).

Intention solves ``(KᵀK + αI) W = KᵀV`` for every batch and head: many small SPD systems. Workload: fp32
SPD ``A = XᵀX/(2n) + I`` (X ``[batch, 2n, n]`` Gaussian) and :data:`CHOL_RHS` right-hand sides
``B [batch, n, 64]``. **ours fused**: ``ae.batched_spd_solve(A, B)`` (factor and solve per matrix, the
factor kept in cache); **ours factor, then solve**: ``ae.batched_cholesky(A)`` (-> ``(L, info)``) then
``ae.batched_cholesky_solve(L, B)``; **torch**: ``torch.linalg.cholesky(A)`` then
``torch.cholesky_solve(B, L)``; the factorisations alone are timed too. Each shape is timed at PyTorch's
default thread count and at one thread (:data:`CHOL_THREADS`).

Goal: ours (fused) at least :data:`MIN_CHOL_SPEEDUP` (5x) faster than torch at ``[4096, 64, 64]``, judged
on the smaller speed-up of the thread counts and re-measured first when it fails or is borderline. The
quick grid is that shape alone; the full grid adds ``[4096, 32, 32]`` and ``[512, 128, 128]``. Where
the ops are not built (no compiled extension) the rows say so and only torch is timed.

The pytest-benchmark functions at the end time each op alone, with an allocation floor:
``python -m pytest bench/bench_batched_cholesky.py --benchmark-only`` (``THP_MEM_ALLOC_ENABLE=1`` for
huge-page outputs).
"""

from __future__ import annotations

import gc
import sys
from typing import Callable

import torch

import attn_ext as ae
from bench.harness import BenchOptions
from bench.harness.goals import confirm, confirmed_text
from bench.harness.machine import load_average, machine_info, machine_markdown
from bench.harness.report import format_ms, markdown_table, progress, publish_run, timing_dict
from bench.harness.timing import WARMUP_TEXT, time_interleaved, torch_threads

NAME = "batched_cholesky"
DTYPE = torch.float32
MIN_CHOL_REPEATS = 3
CHOL_RHS = 64
#: (batch, n) of the rows; the goal is judged at CHOL_GOAL_SHAPE.
CHOL_QUICK_SHAPES: tuple[tuple[int, int], ...] = ((4096, 64),)
CHOL_FULL_SHAPES: tuple[tuple[int, int], ...] = ((4096, 64), (4096, 32), (512, 128))
CHOL_GOAL_SHAPE = (4096, 64)
#: Goal: torch time / ours (fused factor + solve) at least this.
MIN_CHOL_SPEEDUP = 5.0
#: Thread counts each shape is timed with: PyTorch's default (None) and one. On a loaded 2-core machine
#: torch's batched ``cholesky_solve`` at the default count can stall for seconds in OpenMP barriers (seen
#: here: 10.7 s against 0.25 s quiet), which would flatter ours; the 1-thread row is immune to that.
CHOL_THREADS: tuple[int | None, ...] = (None, 1)


def ops_error() -> str | None:
    """Why attn_ext's batched Cholesky ops cannot run here (e.g. no compiled extension), or None."""
    try:
        ae.batched_cholesky(torch.eye(2).expand(1, 2, 2).contiguous())
    except Exception as exc:  # noqa: BLE001 - reported, torch is still timed
        return f"{type(exc).__name__}: {exc}"
    return None


def make_spd(batch: int, n: int, rhs: int = CHOL_RHS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """SPD ``A = XᵀX / (2n) + I`` ``[batch, n, n]`` (X ``[batch, 2n, n]`` Gaussian) and ``B [batch, n, rhs]``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 2 * n, n, generator=gen, dtype=DTYPE)
    a = x.mT @ x / (2 * n) + torch.eye(n, dtype=DTYPE)
    return a, torch.randn(batch, n, rhs, generator=gen, dtype=DTYPE)


def cholesky_calls(a: torch.Tensor, b: torch.Tensor, ours: bool = True) -> dict[str, Callable[[], object]]:
    """Zero-argument callables by name: ``torch`` / ``torch_factor``, and with ``ours`` ``ours_fused`` /
    ``ours`` / ``ours_factor``."""
    calls: dict[str, Callable[[], object]] = {
        "torch": lambda: torch.cholesky_solve(b, torch.linalg.cholesky(a)),
        "torch_factor": lambda: torch.linalg.cholesky(a),
    }
    if ours:
        calls["ours_fused"] = lambda: ae.batched_spd_solve(a, b)
        calls["ours"] = lambda: ae.batched_cholesky_solve(ae.batched_cholesky(a)[0], b)
        calls["ours_factor"] = lambda: ae.batched_cholesky(a)
    return calls


def check_cholesky(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Ours against torch on the benchmark's matrices: relative max differences of L and X (both ways of
    ours), failed factors."""
    l_ref = torch.linalg.cholesky(a)
    x_ref = torch.cholesky_solve(b, l_ref)
    l, info = ae.batched_cholesky(a)
    x = ae.batched_cholesky_solve(l, b)
    x_fused = ae.batched_spd_solve(a, b, check_errors=False)  # a failed matrix gets an all-NaN X
    return {
        "L_rel_diff": ((l.tril() - l_ref).abs().max() / l_ref.abs().max()).item(),
        "X_rel_diff": ((x - x_ref).abs().max() / x_ref.abs().max()).item(),
        "X_fused_rel_diff": ((x_fused - x_ref).abs().max() / x_ref.abs().max()).item(),
        "info_nonzero": int((info != 0).sum().item()) + int(x_fused.isnan().flatten(1).any(1).sum().item()),
    }


def measure_cholesky(options: BenchOptions, batch: int, n: int, step: str, threads: int | None = None,
                     repeats: int | None = None) -> dict:
    """One shape at ``threads`` (None: PyTorch's default): torch always, ours when its ops run (status "ok",
    "not built" or "failed")."""
    with torch_threads(threads) as in_force:
        row = _measure_cholesky(options, batch, n, step, repeats or max(options.repeats, MIN_CHOL_REPEATS))
    row["threads"] = in_force
    return row


def _measure_cholesky(options: BenchOptions, batch: int, n: int, step: str, repeats: int) -> dict:
    error = ops_error()
    a, b = make_spd(batch, n)
    row: dict = {"batch": batch, "n": n, "rhs": CHOL_RHS, "status": "ok" if error is None else "not built",
                 "check": None}
    if error is None:
        try:
            row["check"] = check_cholesky(a, b)
        except Exception as exc:  # noqa: BLE001 - the torch baseline is still timed
            row["status"], error = "failed", f"{type(exc).__name__}: {exc}"
    if error is not None:
        row["error"] = error
    calls = cholesky_calls(a, b, ours=row["status"] == "ok")
    progress(f"{step} Cholesky [{batch}, {n}, {n}] + solve ({CHOL_RHS} RHS, {torch.get_num_threads()} thread(s)): "
             f"{', '.join(calls)} x{repeats}" + (f" (ours {row['status']})" if row["status"] != "ok" else "") + " ...",
             end="")
    row["timings"] = {name: timing_dict(t) for name, t in time_interleaved(calls, repeats=repeats).items()}
    errors = [f"{name}: {t['error']}" for name, t in row["timings"].items() if t.get("error")]
    if errors and row["status"] == "ok":
        row["status"], row["error"] = "failed", "; ".join(errors)
    del calls, a, b
    gc.collect()
    speedup = cholesky_speedup(row)
    progress(" " + ", ".join(f"{name} {format_ms(t['median_ms'])} ms" for name, t in row["timings"].items()
                             if not t.get("error"))
             + (f"; {speedup:.1f}x faster" if speedup else "") + (f"; error: {row['error']}" if row.get("error") else ""))
    return row


def cholesky_speedup(row: dict, factor_only: bool = False, ours: str = "ours_fused") -> float | None:
    """torch / ours: factor + solve (``ours`` = "ours_fused" or the two-op "ours"), or the factor alone."""
    ours, ref = ("ours_factor", "torch_factor") if factor_only else (ours, "torch")
    t = row.get("timings", {})
    o, r = t.get(ours, {}).get("median_ms"), t.get(ref, {}).get("median_ms")
    return r / o if o and r else None


def _goal(rows: list[dict], options: BenchOptions) -> dict:
    """The fused speed-up at CHOL_GOAL_SHAPE, the smaller over the thread counts; re-measured (both thread
    counts again, twice the repeats) when it fails or is borderline."""
    goal_rows = [r for r in rows if (r["batch"], r["n"]) == CHOL_GOAL_SHAPE]
    speedups = [cholesky_speedup(r) for r in goal_rows]
    value = None if not goal_rows or None in speedups else min(speedups)
    repeats = 2 * max(options.repeats, MIN_CHOL_REPEATS)

    def remeasure() -> float | None:
        again = [cholesky_speedup(measure_cholesky(options, *CHOL_GOAL_SHAPE, "[re-measure]", t, repeats))
                 for t in CHOL_THREADS]
        return None if None in again else min(again)

    judged = confirm(value, MIN_CHOL_SPEEDUP, True, remeasure if value is not None else None,
                     f"fused speed-up at {list(CHOL_GOAL_SHAPE)}", progress)
    return {"shape": list(CHOL_GOAL_SHAPE), "min_speedup": MIN_CHOL_SPEEDUP, "value": value, "judged": judged,
            "by_threads": {r["threads"]: s for r, s in zip(goal_rows, speedups)},
            "status": None if not goal_rows else goal_rows[0]["status"], "met": judged["met"]}


def _goal_line(result: dict) -> str:
    g = result["goal"]
    batch, n = g["shape"]
    value = ("ops not built" if g["status"] == "not built" else confirmed_text(g["judged"], lambda x: f"{x:.1f}x"))
    return (f"Goal: fused >= {g['min_speedup']:.0f}x faster than torch at [{batch:,}, {n}, {n}], judged on the smaller "
            "speed-up of the thread counts (on a loaded machine torch's batched `cholesky_solve` with 2 threads can "
            f"stall in OpenMP barriers, which would flatter ours; the quick grid has this shape too): {value}.")


def cholesky_table(rows: list[dict]) -> str:
    table = []
    for r in rows:
        t, built = r["timings"], r["status"] != "not built"

        def ms(name: str) -> str:
            return format_ms(t[name]["median_ms"]) if name in t and not t[name].get("error") else (
                "not built" if not built else "failed")

        sp, sp_pair, spf = (cholesky_speedup(r), cholesky_speedup(r, ours="ours"), cholesky_speedup(r, factor_only=True))
        check = r.get("check")
        diff = None if not check else (f"{check['X_fused_rel_diff']:.1e} / {check['X_rel_diff']:.1e} / "
                                       f"{check['L_rel_diff']:.1e}")
        goal = "not built" if not built else (None if sp is None else ("yes" if sp >= MIN_CHOL_SPEEDUP else "no"))
        table.append([f"{r['batch']:,} x {r['n']} x {r['n']}", r["rhs"], r.get("threads"), ms("ours_fused"),
                      ms("ours"), ms("torch"), *(None if x is None else f"{x:.1f}x" for x in (sp, sp_pair)),
                      ms("ours_factor"), ms("torch_factor"), None if spf is None else f"{spf:.1f}x", diff, goal])
    return markdown_table(["A (batch x n x n)", "RHS", "threads", "ours fused ms", "ours factor, then solve ms",
                           "torch factor, then solve ms", "speed-up (fused)", "speed-up (two ops)",
                           "ours factor ms", "torch factor ms", "speed-up (factor)",
                           "rel. diff to torch: X fused / X / L", f">= {MIN_CHOL_SPEEDUP:.0f}x (fused, this row)"],
                          table, align="l" + "r" * 11 + "l")


def _tables(result: dict) -> str:
    cfg = result["config"]
    return "\n".join([
        f"Batched Cholesky + solve, fp32 SPD `A = XᵀX/(2n) + I`, {CHOL_RHS} right-hand sides; median of "
        f"{cfg['repeats']} after {WARMUP_TEXT}, interleaved. **ours fused**: `ae.batched_spd_solve(A, B)` (factor and "
        "solve per matrix, the factor kept in cache); **ours factor, then solve**: `ae.batched_cholesky(A)` then "
        "`ae.batched_cholesky_solve(L, B)`; **torch**: `torch.linalg.cholesky(A)` then `torch.cholesky_solve(B, L)`. "
        "Speed-up = torch / ours. Rel. diff = max |ours - torch| / max |torch|. Every call allocates its outputs: the "
        "pair writes L and X (128 MB at [4096, 64, 64]) to fresh pages, whose first-touch faults cost about as much "
        "as its arithmetic; the fused op writes X only.",
        "",
        cholesky_table(result["rows"]),
        "",
        _goal_line(result),
        "",
        machine_markdown(result["machine"]),
    ])


def _summary(result: dict) -> tuple[str, str]:
    """The README's short table (one row per shape, speed-ups per thread count) and its sentence with the goal."""
    rows, shapes = result["rows"], [tuple(s) for s in result["config"]["shapes"]]
    threads = list(dict.fromkeys(r["threads"] for r in rows))
    by = {(r["batch"], r["n"], r["threads"]): r for r in rows}

    def cell(r: dict | None, ours: str) -> str | None:
        x = None if r is None else cholesky_speedup(r, ours=ours)
        return None if x is None else f"{x:.1f}x"

    body = [[f"{b:,} x {n} x {n}", *(cell(by.get((b, n, t)), o) for o in ("ours_fused", "ours") for t in threads)]
            for b, n in shapes]
    heads = [f"{what}, {t} thr" for what in ("fused", "two ops") for t in threads]
    return (markdown_table(["A (batch x n x n)", *heads], body),
            "Speed-up of `ae.batched_spd_solve` (fused) and of `ae.batched_cholesky` + `ae.batched_cholesky_solve` "
            f"(two ops) over `torch.linalg.cholesky` + `torch.cholesky_solve`, fp32 SPD, {CHOL_RHS} right-hand sides. "
            + _goal_line(result))


def run(options: BenchOptions) -> int:
    """Run the benchmark; see the module docstring. Exit status 0 on success (also while the ops are not
    built: the report says); 1 when a measurement failed or the README could not be updated."""
    shapes = CHOL_QUICK_SHAPES if options.quick else CHOL_FULL_SHAPES
    machine = machine_info()
    progress(f"{NAME} benchmark ({options.grid} grid): shapes {shapes}; {machine_markdown(machine)}")
    jobs = [(batch, n, threads) for batch, n in shapes for threads in CHOL_THREADS]
    rows = [measure_cholesky(options, batch, n, f"[{j + 1}/{len(jobs)}]", threads)
            for j, (batch, n, threads) in enumerate(jobs)]
    goal = _goal(rows, options)
    machine["load_average_end"] = load_average()
    result = {"benchmark": NAME, "grid": options.grid, "command": options.command, "machine": machine,
              "config": {"shapes": [list(s) for s in shapes], "rhs": CHOL_RHS, "dtype": "fp32", "quick": options.quick,
                         "repeats": max(options.repeats, MIN_CHOL_REPEATS), "warmup": 1},
              "rows": rows, "goal": goal, "warnings": []}
    failed = [f"[{r['batch']}, {r['n']}, {r['n']}] failed: {r['error']}" for r in rows if r["status"] == "failed"]
    failed += [f"[{r['batch']}, {r['n']}, {r['n']}]: {r['check']['info_nonzero']} factorisations reported failure "
               "on SPD input" for r in rows if r.get("check") and r["check"]["info_nonzero"]]
    return publish_run(NAME, result, _tables, _summary, options, None, failed)


# ------------------------------------------------------------------------------ pytest-benchmark
# Defined only under pytest (bench/conftest.py collects bench_*.py), so `python -m bench` needs no pytest.
if "pytest" in sys.modules:
    import pytest

    OPS = ("cholesky", "solve", "cholesky+solve", "fused cholesky+solve")  # torch has no fused form: its pair

    # Module scope + params: each shape's inputs (up to 64 MB per tensor) are built once.
    @pytest.fixture(scope="module", params=CHOL_FULL_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}x{s[1]}")
    def problem(request: pytest.FixtureRequest):
        a, b = make_spd(*request.param)
        return (*request.param, a, b, torch.linalg.cholesky(a))

    @pytest.mark.parametrize("op", OPS)
    @pytest.mark.parametrize("impl", ("ours", "torch"))
    def test_batched_cholesky(benchmark, request: pytest.FixtureRequest, problem, impl: str, op: str):
        batch, n, a, b, l = problem
        if impl == "ours" and ops_error():
            pytest.skip(ops_error())
        calls = ({"cholesky": lambda: ae.batched_cholesky(a), "solve": lambda: ae.batched_cholesky_solve(l, b),
                  "cholesky+solve": lambda: ae.batched_cholesky_solve(ae.batched_cholesky(a)[0], b),
                  "fused cholesky+solve": lambda: ae.batched_spd_solve(a, b)} if impl == "ours" else
                 {"cholesky": lambda: torch.linalg.cholesky(a), "solve": lambda: torch.cholesky_solve(b, l),
                  "cholesky+solve": lambda: torch.cholesky_solve(b, torch.linalg.cholesky(a)),
                  "fused cholesky+solve": lambda: torch.cholesky_solve(b, torch.linalg.cholesky(a))})
        benchmark.group = f"cholesky {batch}x{n}x{n} rhs={CHOL_RHS} {op}"
        benchmark.extra_info.update(batch=batch, n=n, rhs=CHOL_RHS, impl=impl, op=op, dtype="float32",
                                    threads=torch.get_num_threads())
        rounds = max(request.config.getoption("--bench-rounds"), 5)
        benchmark.pedantic(calls[op], rounds=rounds, warmup_rounds=1, iterations=1)

    def test_output_allocation_floor(benchmark, request: pytest.FixtureRequest, problem):
        """What allocating and touching one output of A's size costs, whoever computes it: outputs above
        glibc's 32 MB mmap threshold are fresh pages on every call (15-30 ms for 64 MB on this VM)."""
        batch, n, a, _, _ = problem
        benchmark.group = f"cholesky {batch}x{n}x{n} rhs={CHOL_RHS} cholesky"
        benchmark.extra_info.update(batch=batch, n=n, impl="alloc_floor", op="empty_like+fill_", dtype="float32",
                                    threads=torch.get_num_threads())
        rounds = max(request.config.getoption("--bench-rounds"), 5)
        benchmark.pedantic(lambda: torch.empty_like(a).fill_(0.0), rounds=rounds, warmup_rounds=1, iterations=1)
