"""The batched Cholesky part of ``python -m bench run intention``: ours vs ``torch.linalg`` (SPEC §4).

``torch.linalg.cholesky`` then ``torch.cholesky_solve`` against ours two ways: the fused
``batched_spd_solve`` (factor and solve per matrix, the factor kept in cache; the goal is judged on
it) and the pair ``batched_cholesky`` then ``batched_cholesky_solve``, on fp32 SPD matrices
``A = XᵀX/(2n) + I`` with ``CHOL_RHS`` right-hand sides; the factorisation alone is timed too. Rows
whose ops are not built say so instead of failing.
"""

from __future__ import annotations

import gc
import importlib
from typing import Callable

import torch

from bench.harness import BenchOptions
from bench.harness.report import format_ms, markdown_table, progress, timing_dict, verdict
from bench.harness.timing import time_interleaved, torch_threads

DTYPE = torch.float32
MIN_CHOL_REPEATS = 3
CHOL_RHS = 64
#: (batch, n) of the Cholesky rows; the goal is judged at CHOL_GOAL_SHAPE.
CHOL_QUICK_SHAPES: tuple[tuple[int, int], ...] = ((4096, 64),)
CHOL_FULL_SHAPES: tuple[tuple[int, int], ...] = ((4096, 64), (4096, 32), (512, 128))
CHOL_GOAL_SHAPE = (4096, 64)
#: Goal: torch time / ours (factor + solve) at least this.
MIN_CHOL_SPEEDUP = 5.0
CHOL_CALLS = ("ours_fused", "ours", "torch", "ours_factor", "torch_factor")
#: Thread counts each shape is timed with: PyTorch's default (None) and one. On a loaded 2-core machine
#: torch's batched ``cholesky_solve`` at the default count can stall for seconds in OpenMP barriers (seen
#: here: 10.7 s against 0.25 s quiet), which would flatter ours; the 1-thread row is immune to that.
CHOL_THREADS: tuple[int | None, ...] = (None, 1)

def cholesky_ops():
    """``(batched_cholesky, batched_cholesky_solve, batched_spd_solve)`` of ``torch.ops.attn_ext``, or None
    while not built."""
    importlib.import_module("attn_ext")  # loads the extension, which registers the ops
    ns = torch.ops.attn_ext
    names = ("batched_cholesky", "batched_cholesky_solve", "batched_spd_solve")
    if not all(hasattr(ns, name) for name in names):
        return None
    return tuple(getattr(ns, name) for name in names)


def make_spd(batch: int, n: int, rhs: int = CHOL_RHS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """SPD ``A = XᵀX / (2n) + I`` ``[batch, n, n]`` (X ``[batch, 2n, n]`` Gaussian) and ``B [batch, n, rhs]``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 2 * n, n, generator=gen, dtype=DTYPE)
    a = x.mT @ x / (2 * n) + torch.eye(n, dtype=DTYPE)
    b = torch.randn(batch, n, rhs, generator=gen, dtype=DTYPE)
    return a, b


def cholesky_calls(a: torch.Tensor, b: torch.Tensor, ops=None) -> dict[str, Callable[[], object]]:
    """Zero-argument callables by name: ``torch`` / ``torch_factor``, and ``ours_fused`` / ``ours`` /
    ``ours_factor`` when ``ops`` (as returned by :func:`cholesky_ops`) is given."""
    calls: dict[str, Callable[[], object]] = {
        "torch": lambda: torch.cholesky_solve(b, torch.linalg.cholesky(a)),
        "torch_factor": lambda: torch.linalg.cholesky(a),
    }
    if ops is not None:
        chol, solve, fused = ops
        calls["ours_fused"] = lambda: fused(a, b)
        calls["ours"] = lambda: solve(chol(a)[0], b)
        calls["ours_factor"] = lambda: chol(a)
    return calls


def check_cholesky(a: torch.Tensor, b: torch.Tensor, ops) -> dict:
    """Ours against torch on the benchmark's matrices: relative max differences of L and X (both ways of
    ours), failed factors."""
    chol, solve, fused = ops
    l_ref = torch.linalg.cholesky(a)
    x_ref = torch.cholesky_solve(b, l_ref)
    l, info = chol(a)
    x = solve(l, b)
    x_fused, info_fused = fused(a, b)
    return {
        "L_rel_diff": ((l.tril() - l_ref).abs().max() / l_ref.abs().max()).item(),
        "X_rel_diff": ((x - x_ref).abs().max() / x_ref.abs().max()).item(),
        "X_fused_rel_diff": ((x_fused - x_ref).abs().max() / x_ref.abs().max()).item(),
        "info_nonzero": int((info != 0).sum().item()) + int((info_fused != 0).sum().item()),
    }


def measure_cholesky(options: BenchOptions, batch: int, n: int, step: str, threads: int | None = None) -> dict:
    """One shape at ``threads`` (None: PyTorch's default): torch always, ours when its ops exist (status "ok",
    "not built" or "failed")."""
    with torch_threads(threads) as in_force:
        row = _measure_cholesky(options, batch, n, step)
    row["threads"] = in_force
    return row


def _measure_cholesky(options: BenchOptions, batch: int, n: int, step: str) -> dict:
    repeats = max(options.repeats, MIN_CHOL_REPEATS)
    ops = cholesky_ops()
    a, b = make_spd(batch, n)
    row: dict = {"batch": batch, "n": n, "rhs": CHOL_RHS, "status": "ok" if ops else "not built", "check": None}
    if ops is not None:
        try:
            row["check"] = check_cholesky(a, b, ops)
        except Exception as exc:  # noqa: BLE001 - the torch baseline is still timed
            row["status"], row["error"] = "failed", f"{type(exc).__name__}: {exc}"
            ops = None
    calls = cholesky_calls(a, b, ops)
    progress(f"{step} Cholesky [{batch}, {n}, {n}] + solve ({CHOL_RHS} RHS, {torch.get_num_threads()} thread(s)): "
             f"{', '.join(calls)} x{repeats}"
             + (f" (ours {row['status']})" if row["status"] != "ok" else "") + " ...", end="")
    timed = time_interleaved(calls, repeats=repeats)
    row["timings"] = {name: timing_dict(t) for name, t in timed.items()}
    errors = [f"{name}: {t['error']}" for name, t in row["timings"].items() if t.get("error")]
    if errors and row["status"] == "ok":
        row["status"], row["error"] = "failed", "; ".join(errors)
    del calls, timed, a, b
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


def cholesky_table(chol_rows: list[dict]) -> str:
    table = []
    for r in chol_rows:
        t = r["timings"]
        built = r["status"] != "not built"
        missing = "not built" if not built else "failed"

        def ms(name: str) -> str:
            return format_ms(t[name]["median_ms"]) if name in t and not t[name].get("error") else missing

        def times(x: float | None) -> str | None:
            return None if x is None else f"{x:.1f}x"

        sp, sp_pair, spf = (cholesky_speedup(r), cholesky_speedup(r, ours="ours"),
                            cholesky_speedup(r, factor_only=True))
        check = r.get("check")
        diff = None if not check else (f"{check['X_fused_rel_diff']:.1e} / {check['X_rel_diff']:.1e} / "
                                       f"{check['L_rel_diff']:.1e}")
        goal = "not built" if not built else verdict(None if sp is None else sp >= MIN_CHOL_SPEEDUP)
        table.append([f"{r['batch']:,} x {r['n']} x {r['n']}", r["rhs"], r.get("threads"), ms("ours_fused"), ms("ours"), ms("torch"),
                      times(sp), times(sp_pair), ms("ours_factor"), ms("torch_factor"), times(spf), diff, goal])
    return markdown_table(["A (batch x n x n)", "RHS", "threads", "ours fused ms", "ours factor, then solve ms",
                           "torch factor, then solve ms", "speed-up (fused)", "speed-up (two ops)",
                           "ours factor ms", "torch factor ms", "speed-up (factor)",
                           "rel. diff to torch: X fused / X / L", f">= {MIN_CHOL_SPEEDUP:.0f}x (fused)"], table,
                          align="l" + "r" * 11 + "l")
