"""``attn-ext bench intention``: Intention and σIntention vs SDPA, and the batched Cholesky ops.

Part 1, attention (B=8, H=4, M=N queries and keys, D=Dv=64, fp32, CPU). For each
N it times, in this process with the samples of the three implementations interleaved,

* **Intention**: ``ae.intention(q, k, v, alpha=1, form="primal", backend=...)``;
* **σIntention**: ``ae.sigma_intention(q, k, v, alpha=1, backend=...)``;
* **SDPA**: ``torch.nn.functional.scaled_dot_product_attention(q, k, v)``;

forward (inputs without ``requires_grad``) and forward+backward (forward, then
``torch.autograd.grad(out, (q, k, v), grad_out)`` with a fixed random ``grad_out``),
and reports ours / SDPA. The issue's goal: within :data:`MAX_RATIO` (1.5x) of SDPA
(the paper reports 1-4x); the report states per row and implementation whether it holds.

N is 256, 1024 and 4096 in both runs, but ``--quick`` skips forward+backward at
N = 4096 (:data:`QUICK_BWD_MAX_N`): there σIntention and SDPA take ~6 s per call
each on 2 cores, ~80 s for the warm-up and 5 repeats, which would double the quick
run; the forward at N = 4096 costs ~25 s and is kept, as the largest N is where
Intention's linear cost separates from SDPA's quadratic one.

Part 2, batched Cholesky: SPD matrices ``A = XᵀX / (2n) + I`` (X ``[batch, 2n, n]``)
and 64 right-hand sides ``B [batch, n, 64]``, fp32. **ours**:
``torch.ops.attn_ext.batched_cholesky(A)`` (-> ``(L, info)``) then
``torch.ops.attn_ext.batched_cholesky_solve(L, B)``; **torch**:
``torch.linalg.cholesky(A)`` then ``torch.cholesky_solve(B, L)``. Both the pair and
the factorisation alone are timed. Goal: ours at least :data:`MIN_CHOL_SPEEDUP`
(5x) faster at ``[4096, 64, 64]`` (the quick run's only shape; the full run adds
``[4096, 32, 32]`` and ``[512, 128, 128]``). While the ops are not in the
extension, the rows say "not built" and only torch is timed.

Writes ``intention.{md,json,png}`` to the output directory and prints the
Markdown block to stdout; progress goes to stderr.
"""

from __future__ import annotations

import gc
import importlib
from typing import Callable

import torch

from . import BenchOptions
from .cross_attention_workload import make_call
from .machine import load_average, machine_markdown
from .plot import Series, plot_panel
from .report import format_ms, markdown_table, progress, publish, start_run
from .timing import time_interleaved

NAME = "intention"
B, H, D, DV = 8, 4, 64, 64
DTYPE = torch.float32
ALPHA = 1.0
FULL_NS: tuple[int, ...] = (256, 1024, 4096)
QUICK_NS: tuple[int, ...] = FULL_NS
#: ``--quick``: forward+backward only up to this N (see the module docstring).
QUICK_BWD_MAX_N = 1024
IMPLS: tuple[str, ...] = ("intention", "sigma_intention", "sdpa")
LABELS = {"intention": "Intention", "sigma_intention": "σIntention", "sdpa": "SDPA"}
PASSES: tuple[str, ...] = ("fwd", "fwd+bwd")
#: Goal: ours / SDPA (time) at most this.
MAX_RATIO = 1.5
MIN_REPEATS = 3
#: Calls at small N take a few ms: each sample is the mean of SMALL_N_CALLS // N back-to-back calls.
SMALL_N_CALLS = 1024
#: Relative difference of the cpp kernels to the reference backend above which the report warns.
CHECK_RTOL = 1e-3

CHOL_RHS = 64
#: (batch, n) of the Cholesky rows; the goal is judged at CHOL_GOAL_SHAPE.
CHOL_QUICK_SHAPES: tuple[tuple[int, int], ...] = ((4096, 64),)
CHOL_FULL_SHAPES: tuple[tuple[int, int], ...] = ((4096, 64), (4096, 32), (512, 128))
CHOL_GOAL_SHAPE = (4096, 64)
#: Goal: torch time / ours (factor + solve) at least this.
MIN_CHOL_SPEEDUP = 5.0
CHOL_CALLS = ("ours", "torch", "ours_factor", "torch_factor")


# --------------------------------------------------------------------------- attention


def make_inputs(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``q [B,H,n,D]``, ``k [B,H,n,D]``, ``v [B,H,n,Dv]`` (M = N; fp32, CPU, no grad)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, n, D, generator=gen, dtype=DTYPE)
    k = torch.randn(B, H, n, D, generator=gen, dtype=DTYPE)
    v = torch.randn(B, H, n, DV, generator=gen, dtype=DTYPE)
    return q, k, v


def implementation(impl: str, backend: str = "cpp") -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """Callable ``f(q, k, v) -> out`` of ``impl`` (one of :data:`IMPLS`)."""
    import attn_ext as ae

    if impl == "intention":
        return lambda q, k, v: ae.intention(q, k, v, alpha=ALPHA, form="primal", backend=backend)
    if impl == "sigma_intention":
        return lambda q, k, v: ae.sigma_intention(q, k, v, alpha=ALPHA, backend=backend)
    if impl == "sdpa":
        return torch.nn.functional.scaled_dot_product_attention
    raise ValueError(f"unknown implementation {impl!r}; expected one of {IMPLS}")


def number_of_calls(n: int) -> int:
    """Back-to-back calls per sample at ``n`` (their mean is the sample)."""
    return max(1, SMALL_N_CALLS // n)


def passes_for(n: int, quick: bool) -> tuple[str, ...]:
    """Passes measured at ``n``: forward+backward is skipped above QUICK_BWD_MAX_N in a quick run."""
    return ("fwd",) if quick and n > QUICK_BWD_MAX_N else PASSES


def check_against_reference(backend: str, n: int = 256) -> dict:
    """Relative max difference of Intention and σIntention with ``backend`` to the reference backend.

    On ``[1, H, n, D]`` slices of the benchmark's inputs; a kernel that is fast but wrong is
    flagged in the report rather than timed silently. Errors are returned, not raised.
    """
    import attn_ext as ae

    q, k, v = (t[:1] for t in make_inputs(n))
    out: dict = {}
    for impl, fn in (("intention", ae.intention), ("sigma_intention", ae.sigma_intention)):
        kwargs = {"form": "primal"} if impl == "intention" else {}
        try:
            ours = fn(q, k, v, alpha=ALPHA, backend=backend, **kwargs)
            ref = fn(q, k, v, alpha=ALPHA, backend="reference", **kwargs)
            out[impl] = ((ours - ref).abs().max() / ref.abs().max()).item()
        except Exception as exc:  # noqa: BLE001 - reported, the timing may still work
            out[impl] = f"{type(exc).__name__}: {exc}"
    return out


def _timing_dict(t) -> dict:
    if isinstance(t, Exception):
        return {"median_ms": None, "samples_ms": [], "error": f"{type(t).__name__}: {t}"}
    return {"median_ms": t.median_ms, "samples_ms": list(t.samples_ms)}


def _measure_attention(options: BenchOptions, n: int, step: str) -> list[dict]:
    """One N: per pass, the three implementations with their samples interleaved."""
    repeats, number = max(options.repeats, MIN_REPEATS), number_of_calls(n)
    q, k, v = make_inputs(n)
    rows = []
    # fwd first: make_call switches requires_grad on the shared inputs for the pass it builds.
    for pass_ in passes_for(n, options.quick):
        progress(f"{step} N={n:,} {pass_}: {', '.join(LABELS[i] for i in IMPLS)} x{repeats}"
                 + (f"x{number}" if number > 1 else "") + " ...", end="")
        calls = {impl: make_call(implementation(impl, options.backend), pass_, q, k, v) for impl in IMPLS}
        timed = time_interleaved(calls, repeats=repeats, number=number)
        row = {"N": n, "pass": pass_, "number": number, "impls": {i: _timing_dict(timed[i]) for i in IMPLS}}
        rows.append(row)
        del calls, timed
        gc.collect()
        sdpa = row["impls"]["sdpa"]["median_ms"]
        parts = []
        for impl in IMPLS:
            t = row["impls"][impl]
            if t.get("error"):
                parts.append(f"{LABELS[impl]} failed: {t['error']}")
            else:
                ratio = f" ({t['median_ms'] / sdpa:.2f}x)" if impl != "sdpa" and sdpa else ""
                parts.append(f"{LABELS[impl]} {format_ms(t['median_ms'])} ms{ratio}")
        progress(" " + ", ".join(parts))
    return rows


def _ratio(row: dict, impl: str) -> float | None:
    ours, sdpa = row["impls"][impl]["median_ms"], row["impls"]["sdpa"]["median_ms"]
    return ours / sdpa if ours and sdpa else None


# --------------------------------------------------------------------------- Cholesky


def cholesky_ops():
    """``(batched_cholesky, batched_cholesky_solve)`` of ``torch.ops.attn_ext``, or None while not built."""
    importlib.import_module("attn_ext")  # loads the extension, which registers the ops
    ns = torch.ops.attn_ext
    if not (hasattr(ns, "batched_cholesky") and hasattr(ns, "batched_cholesky_solve")):
        return None
    return ns.batched_cholesky, ns.batched_cholesky_solve


def make_spd(batch: int, n: int, rhs: int = CHOL_RHS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """SPD ``A = XᵀX / (2n) + I`` ``[batch, n, n]`` (X ``[batch, 2n, n]`` Gaussian) and ``B [batch, n, rhs]``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 2 * n, n, generator=gen, dtype=DTYPE)
    a = x.mT @ x / (2 * n) + torch.eye(n, dtype=DTYPE)
    b = torch.randn(batch, n, rhs, generator=gen, dtype=DTYPE)
    return a, b


def cholesky_calls(a: torch.Tensor, b: torch.Tensor, ops=None) -> dict[str, Callable[[], object]]:
    """Zero-argument callables by name: ``torch`` / ``torch_factor``, and ``ours`` / ``ours_factor`` when
    ``ops`` (as returned by :func:`cholesky_ops`) is given."""
    calls: dict[str, Callable[[], object]] = {
        "torch": lambda: torch.cholesky_solve(b, torch.linalg.cholesky(a)),
        "torch_factor": lambda: torch.linalg.cholesky(a),
    }
    if ops is not None:
        chol, solve = ops
        calls["ours"] = lambda: solve(chol(a)[0], b)
        calls["ours_factor"] = lambda: chol(a)
    return calls


def check_cholesky(a: torch.Tensor, b: torch.Tensor, ops) -> dict:
    """Ours against torch on the benchmark's matrices: relative max differences of L and X, failed factors."""
    chol, solve = ops
    l_ref = torch.linalg.cholesky(a)
    x_ref = torch.cholesky_solve(b, l_ref)
    l, info = chol(a)
    x = solve(l, b)
    return {
        "L_rel_diff": ((l.tril() - l_ref).abs().max() / l_ref.abs().max()).item(),
        "X_rel_diff": ((x - x_ref).abs().max() / x_ref.abs().max()).item(),
        "info_nonzero": int((info != 0).sum().item()),
    }


def _measure_cholesky(options: BenchOptions, batch: int, n: int, step: str) -> dict:
    """One shape: torch always, ours when its ops exist (status "ok", "not built" or "failed")."""
    repeats = max(options.repeats, MIN_REPEATS)
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
    progress(f"{step} Cholesky [{batch}, {n}, {n}] + solve ({CHOL_RHS} RHS): {', '.join(calls)} x{repeats}"
             + (f" (ours {row['status']})" if row["status"] != "ok" else "") + " ...", end="")
    timed = time_interleaved(calls, repeats=repeats)
    row["timings"] = {name: _timing_dict(t) for name, t in timed.items()}
    errors = [f"{name}: {t['error']}" for name, t in row["timings"].items() if t.get("error")]
    if errors and row["status"] == "ok":
        row["status"], row["error"] = "failed", "; ".join(errors)
    del calls, timed, a, b
    gc.collect()
    speedup = _chol_speedup(row)
    progress(" " + ", ".join(f"{name} {format_ms(t['median_ms'])} ms" for name, t in row["timings"].items()
                             if not t.get("error"))
             + (f"; {speedup:.1f}x faster" if speedup else "") + (f"; error: {row['error']}" if row.get("error") else ""))
    return row


def _chol_speedup(row: dict, factor_only: bool = False) -> float | None:
    ours, ref = ("ours_factor", "torch_factor") if factor_only else ("ours", "torch")
    t = row.get("timings", {})
    o, r = t.get(ours, {}).get("median_ms"), t.get(ref, {}).get("median_ms")
    return r / o if o and r else None


# --------------------------------------------------------------------------- report


def _goals(rows: list[dict], chol_rows: list[dict]) -> dict:
    attention = {}
    for impl in IMPLS[:2]:
        ratios = [_ratio(r, impl) for r in rows]
        met = [x <= MAX_RATIO for x in ratios if x is not None]
        attention[impl] = {"rows_met": sum(met), "rows_measured": len(met), "rows": len(rows),
                           "met": None if not met else all(met)}
    goal_row = next((r for r in chol_rows if (r["batch"], r["n"]) == CHOL_GOAL_SHAPE), None)
    speedup = None if goal_row is None else _chol_speedup(goal_row)
    return {
        "attention": {"max_ratio": MAX_RATIO, "per_impl": attention},
        "cholesky": {"shape": list(CHOL_GOAL_SHAPE), "min_speedup": MIN_CHOL_SPEEDUP, "value": speedup,
                     "status": None if goal_row is None else goal_row["status"],
                     "met": None if speedup is None else speedup >= MIN_CHOL_SPEEDUP},
    }


def _verdict(met: bool | None) -> str:
    return {True: "met", False: "NOT met", None: "not measured"}[met]


def _row_verdict(ratio: float | None) -> str:
    return "n/a" if ratio is None else ("met" if ratio <= MAX_RATIO else "NOT met")


def _attention_table(rows: list[dict]) -> str:
    table = []
    for r in rows:
        t = {i: r["impls"][i]["median_ms"] for i in IMPLS}
        ri, rs = _ratio(r, "intention"), _ratio(r, "sigma_intention")
        table.append([f"{r['N']:,}", r["pass"], format_ms(t["intention"]), format_ms(t["sigma_intention"]),
                      format_ms(t["sdpa"]), None if ri is None else f"{ri:.2f}x", None if rs is None else f"{rs:.2f}x",
                      f"{_row_verdict(ri)} / {_row_verdict(rs)}"])
    return markdown_table(["N (= M)", "pass", "Intention ms", "σIntention ms", "SDPA ms", "Intention / SDPA",
                           "σIntention / SDPA", f"<= {MAX_RATIO}x SDPA (Intention / σIntention)"], table,
                          align="ll" + "r" * 5 + "l")


def _cholesky_table(chol_rows: list[dict]) -> str:
    table = []
    for r in chol_rows:
        t = r["timings"]
        built = r["status"] != "not built"
        ours = format_ms(t["ours"]["median_ms"]) if "ours" in t else ("not built" if not built else "failed")
        ours_f = format_ms(t["ours_factor"]["median_ms"]) if "ours_factor" in t else ours
        sp, spf = _chol_speedup(r), _chol_speedup(r, factor_only=True)
        check = r.get("check")
        diff = None if not check else f"{check['X_rel_diff']:.1e} / {check['L_rel_diff']:.1e}"
        verdict = "not built" if not built else _verdict(None if sp is None else sp >= MIN_CHOL_SPEEDUP)
        table.append([f"{r['batch']:,} x {r['n']} x {r['n']}", r["rhs"], ours, format_ms(t["torch"]["median_ms"]),
                      None if sp is None else f"{sp:.1f}x", ours_f, format_ms(t["torch_factor"]["median_ms"]),
                      None if spf is None else f"{spf:.1f}x", diff, verdict])
    return markdown_table(["A (batch x n x n)", "RHS", "ours factor + solve ms", "torch factor + solve ms",
                           "speed-up", "ours factor ms", "torch factor ms", "speed-up (factor)",
                           "ours vs torch rel. diff X / L", f">= {MIN_CHOL_SPEEDUP:.0f}x"], table,
                          align="l" + "r" * 8 + "l")


def _tables(result: dict) -> str:
    """Markdown block: setup, the two tables, the goals, the machine."""
    cfg, rows, chol_rows, goals = result["config"], result["rows"], result["cholesky_rows"], result["goals"]
    att = goals["attention"]["per_impl"]
    ch = goals["cholesky"]
    skipped = [n for n in cfg["Ns"] if n > QUICK_BWD_MAX_N] if cfg["quick"] else []
    lines = [
        f"Intention `ae.intention(q, k, v, alpha={ALPHA:g}, form=\"primal\")` and σIntention "
        f"`ae.sigma_intention(q, k, v, alpha={ALPHA:g})` vs `scaled_dot_product_attention` (SDPA), "
        f"B={cfg['B']}, H={cfg['H']}, M=N queries and keys, D=Dv={cfg['D']}, {cfg['dtype']}, CPU, backend "
        f"{cfg['backend']}; median of {cfg['repeats']} samples after 1 warm-up, the three implementations' samples "
        f"interleaved (at N={cfg['Ns'][0]:,} each sample is the mean of {number_of_calls(cfg['Ns'][0])} "
        "back-to-back calls). **fwd+bwd**: forward, then `torch.autograd.grad(out, (q, k, v), grad_out)`."
        + (f" Quick run: fwd+bwd not measured at N={', '.join(f'{n:,}' for n in skipped)}." if skipped else ""),
        "",
        _attention_table(rows),
        "",
        f"Goal (issue: within {MAX_RATIO}x of SDPA; the paper reports 1-4x): Intention met in "
        f"{att['intention']['rows_met']} of {att['intention']['rows']} rows, **{_verdict(att['intention']['met'])}**; "
        f"σIntention met in {att['sigma_intention']['rows_met']} of {att['sigma_intention']['rows']} rows, "
        f"**{_verdict(att['sigma_intention']['met'])}**. Intention's cost is linear in N (the keys enter through "
        "KᵀK and KᵀV), SDPA's quadratic; σIntention is the transformed queries plus a softmax attention over all "
        "N keys (`ae.cross_attention`), so it costs at least as much as softmax attention.",
        "",
        f"Batched Cholesky + solve, fp32 SPD `A = XᵀX/(2n) + I`, {CHOL_RHS} right-hand sides; median of "
        f"{cfg['repeats']} after 1 warm-up, interleaved. **ours**: `torch.ops.attn_ext.batched_cholesky(A)` then "
        "`batched_cholesky_solve(L, B)`; **torch**: `torch.linalg.cholesky(A)` then `torch.cholesky_solve(B, L)`. "
        "Speed-up = torch / ours. Rel. diff = max |ours - torch| / max |torch| of X and of L.",
        "",
        _cholesky_table(chol_rows),
        "",
        f"Goal: >= {MIN_CHOL_SPEEDUP:.0f}x faster than torch at [{ch['shape'][0]:,}, {ch['shape'][1]}, "
        f"{ch['shape'][1]}]: "
        + ("ops not built yet" if ch["status"] == "not built"
           else ("n/a" if ch["value"] is None else f"{ch['value']:.1f}x") + f", **{_verdict(ch['met'])}**") + ".",
        "",
        "The machine is shared with other jobs: absolute times are noisy (see the load averages); the "
        "interleaving keeps the ratios fairer than the times.",
        "",
        machine_markdown(result["machine"]),
    ]
    return "\n".join(lines)


def _plot(result: dict, path) -> None:
    rows, cfg = result["rows"], result["config"]
    series = []
    for c, impl in enumerate(IMPLS):
        for pass_, style, marker in (("fwd", "-", "o"), ("fwd+bwd", "--", "^")):
            pts = [(r["N"], r["impls"][impl]["median_ms"]) for r in rows if r["pass"] == pass_]
            if pts:
                xs, ys = zip(*pts)
                series.append(Series(f"{LABELS[impl]} {pass_}", xs, ys, style, marker, "k" if impl == "sdpa" else f"C{c}"))
    plot_panel(series, path,
               title=f"Intention / σIntention vs SDPA, B={cfg['B']} H={cfg['H']} M=N D={cfg['D']} fp32",
               xlabel="N (= M, keys and queries)", ylabel="time (ms, median)")


def run(options: BenchOptions) -> int:
    """Run the benchmark; see the module docstring.

    Returns
    -------
    int
        0 on success (whether or not the goals are met, and also while the Cholesky ops are not
        built: the report says); 2 when attn_ext's attention cannot run with the backend; 1 when a
        measurement failed or the README could not be updated.
    """
    started = start_run(NAME, options, QUICK_NS, FULL_NS)
    if isinstance(started, int):
        return started
    ns, machine, warnings = started
    check = check_against_reference(options.backend)
    for impl, diff in check.items():
        if isinstance(diff, str):
            warnings.append(f"{LABELS[impl]} check against the reference backend failed: {diff}")
        elif not diff <= CHECK_RTOL:
            warnings.append(f"{LABELS[impl]} ({options.backend}) differs from the reference backend by "
                            f"{diff:.2g} relative (> {CHECK_RTOL:g})")
    shapes = CHOL_QUICK_SHAPES if options.quick else CHOL_FULL_SHAPES
    total = len(ns) + len(shapes)
    rows: list[dict] = []
    for i, n in enumerate(ns):
        rows += _measure_attention(options, n, f"[{i + 1}/{total}]")
        gc.collect()
    chol_rows = [_measure_cholesky(options, batch, n, f"[{len(ns) + j + 1}/{total}]")
                 for j, (batch, n) in enumerate(shapes)]
    machine["load_average_end"] = load_average()
    result = {
        "benchmark": NAME,
        "config": {"B": B, "H": H, "D": D, "Dv": DV, "M": "N", "dtype": "fp32", "device": "cpu", "Ns": list(ns),
                   "alpha": ALPHA, "form": "primal", "backend": options.backend, "quick": options.quick,
                   "repeats": max(options.repeats, MIN_REPEATS), "warmup": 1,
                   "quick_bwd_max_n": QUICK_BWD_MAX_N, "cholesky_shapes": [list(s) for s in shapes],
                   "cholesky_rhs": CHOL_RHS},
        "machine": machine,
        "reference_check_rel_diff": check,
        "rows": rows,
        "cholesky_rows": chol_rows,
        "goals": _goals(rows, chol_rows),
        "warnings": warnings,
    }
    failed = [f"N={r['N']:,} {r['pass']} {LABELS[i]} failed: {t['error']}"
              for r in rows for i, t in r["impls"].items() if t.get("error")]
    failed += [f"Cholesky [{r['batch']}, {r['n']}, {r['n']}] failed: {r['error']}"
               for r in chol_rows if r["status"] == "failed"]
    failed += [f"Cholesky [{r['batch']}, {r['n']}, {r['n']}]: {r['check']['info_nonzero']} factorisations "
               "reported info != 0 on SPD input" for r in chol_rows if r.get("check") and r["check"]["info_nonzero"]]
    result["warnings"] += failed
    block = _tables(result) + "".join(f"\n\nWarning: {w}" for w in result["warnings"])
    ok = publish(NAME, block, result, options.out_dir, _plot, options.update_readme)
    return 1 if failed or not ok else 0
