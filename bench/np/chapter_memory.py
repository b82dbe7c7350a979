"""``python -m bench run chapter_memory``: the efficient-NP-transformers chapter's memory table on its grid.

The chapter (its Table 0.6.1) reports the memory of one inference on 2-D inputs for eight
``(N_c, N_t)`` pairs: N_c ∈ {10, 100, 1000, 5000} × N_t ∈ {10, 1000}. This module measures every
model of :data:`attn_ext.models.MODELS` (and TNP-D's masked formulation) on that grid, each cell in
a fresh process, with the probe of :mod:`bench.np.np_memory` (peak extra RSS of one prediction,
batch 1, fp32, CPU, default sizes, ``dim_x = 2``), and prints the chapter's MB beside ours.

Two things differ from the chapter, so compare shapes of growth, not absolute MB: the chapter's
models have about a million parameters and its figures include the weights and inputs (its smallest
cells read 13–24 MB); ours count only the memory a prediction adds above the weights and inputs.
The table therefore also gives each model's weight size.
"""
from __future__ import annotations

import datetime
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from attn_ext.models import MODELS, build_model
from bench.harness.machine import load_average, machine_info, machine_markdown
from bench.harness.memory import measure_peak_extra
from bench.harness.plot import Series, plot_time_and_memory
from bench.harness.report import markdown_table, progress, publish
from bench.np.np_memory import _status

NAME = "chapter_memory"
#: The chapter's grid (Table 0.6.1), in its row order.
GRID: tuple = ((10, 10), (100, 10), (1_000, 10), (5_000, 10), (10, 1_000), (100, 1_000), (1_000, 1_000),
               (5_000, 1_000))
QUICK_GRID: tuple = ((10, 10), (1_000, 1_000))
#: Beyond the chapter's grid: the translation-equivariant models, whose attention (``ae.te_attention``) holds no
#: ``[N, N]`` tensor, at context sizes the chapter could not reach (its TETNP took 24 GB at N_c = 5,000).
TE_MODELS: tuple = ("tetnp", "pt_tetnp")
LINEAR_GRID: tuple = ((5_000, 1_000), (10_000, 1_000), (20_000, 1_000), (50_000, 1_000), (100_000, 1_000))
#: The largest N_c of LINEAR_GRID each TE model is measured at. TETNP's context self-attention is quadratic in time
#: (its memory linear): on one thread of the 2-core machine N_c = 20,000 took 333 s, so 100,000 would take over two
#: hours (25x); PT-TETNP's attention is linear in time too.
LINEAR_MAX_NC = {"tetnp": 50_000, "pt_tetnp": 100_000}
LINEAR_TIMEOUT = 3600.0
DIM_X = 2
#: The chapter's columns -> its MB per grid cell (GRID's order) and the model of ours it names.
CHAPTER_MB = {
    "HyperMixNP": ("hypermix_np", (16, 16, 23, 69, 19, 19, 24, 70)),
    "LinearTNP": ("linear_tnp", (16, 16, 31, 109, 25, 31, 32, 109)),
    "PT-TNP": ("ist", (19, 19, 50, 190, 51, 51, 51, 191)),
    "ConvNP": ("convnp", (24, 29, 257, 1273, 268, 268, 268, 1273)),
    "TETNP": ("tetnp", (13, 23, 984, 24082, 26, 113, 985, 24083)),
}


def all_models() -> list:
    """Every registered model, plus ``tnpd_masked`` (TNP-D's official quadratic formulation)."""
    names = sorted(MODELS)
    return names[:names.index("tnpd") + 1] + ["tnpd_masked"] + names[names.index("tnpd") + 1:]


def weights_mb(model: str) -> Optional[float]:
    """Parameter memory (MB, fp32) of ``model`` at its default sizes with 2-D inputs."""
    try:
        net = build_model("tnpd" if model == "tnpd_masked" else model, dim_x=DIM_X)
    except Exception:  # a model that cannot be built shows up as `failed` in its cells with the reason
        return None
    return sum(p.numel() * p.element_size() for p in net.parameters()) / 1e6


def measure(models: Sequence[str], grid: Sequence[tuple], *, cap_mb: float, timeout: float, log=None) -> list:
    """One fresh-process probe per (model, N_c, N_t)."""
    log = log or progress
    cells = [(m, nc, nt) for m in models for nc, nt in grid]
    rows = []
    for i, (model, nc, nt) in enumerate(cells, 1):
        log(f"[{i}/{len(cells)}] {model} N_c={nc:,} N_t={nt:,} ...", end="")
        start = time.perf_counter()
        mem = measure_peak_extra("bench.np.np_memory:memory_probe",
                                 {"model": model, "n_context": nc, "n_target": nt, "cap_mb": cap_mb, "dim_x": DIM_X},
                                 timeout=timeout)
        elapsed = time.perf_counter() - start
        status = _status(mem, elapsed, timeout)
        log(f" {status} ({elapsed:.0f} s)")
        rows.append({"model": model, "N_c": nc, "N_t": nt, "peak_extra_mb": mem.mb, "status": status,
                     "note": mem.note, "probe_seconds": round(elapsed, 1)})
    return rows


def _cell(rows, model, nc, nt) -> Optional[str]:
    return next((r["status"] for r in rows if r["model"] == model and r["N_c"] == nc and r["N_t"] == nt), None)


def tables(result: dict) -> str:
    cfg, rows = result["config"], result["rows"]
    grid = [tuple(g) for g in cfg["grid"]]
    ours = markdown_table(["N_c", "N_t"] + cfg["models"],
                          [[f"{nc:,}", f"{nt:,}"] + [_cell(rows, m, nc, nt) for m in cfg["models"]] for nc, nt in grid])
    weights = markdown_table(["model", "weights (MB, fp32)"],
                             [[m, None if result["weights_mb"].get(m) is None else f"{result['weights_mb'][m]:.2f}"]
                              for m in cfg["models"]])
    side = []
    for nc, nt in grid:
        row = [f"{nc:,}", f"{nt:,}"]
        for column, (model, figures) in CHAPTER_MB.items():
            chapter = dict(zip(GRID, figures)).get((nc, nt))
            row.append(f"{chapter} / {_cell(rows, model, nc, nt)}")
        side.append(row)
    beside = markdown_table(["N_c", "N_t"] + [f"{c} (`{m}`)" for c, (m, _) in CHAPTER_MB.items()], side)
    return "\n".join([
        f"Peak extra memory (MB) of one prediction on **2-D inputs**, batch 1, fp32, CPU, default sizes, random "
        f"weights, no autograd; a fresh process per cell; the grid of the efficient-NP-transformers chapter's memory "
        f"table. CMANP(-AND) condition in chunks of 1024 points; CMANP-AND draws a block-autoregressive sample "
        f"(b_Q = 5). `> cap`: more than {cfg['cap_mb']:,.0f} MB; `timeout`: over {cfg['timeout']:.0f} s; `failed`: "
        "the model could not run (reason in the JSON).",
        "",
        ours,
        "",
        "**Beside the chapter** (chapter MB / ours). The chapter's models have about 1M parameters and its figures "
        "include weights and inputs (its smallest cells: 13–24 MB); ours are the memory a prediction adds. Compare "
        "how each column grows with N_c and N_t. PT-TNP is the chapter's name for the pseudo-token models "
        "(IST and LBANP); `ist` is shown, `lbanp` is in the table above.",
        "",
        beside,
        "",
        *_linear_section(result),
        "Weights of our models at these sizes:",
        "",
        weights,
        "",
        *_merge_note(result),
        machine_markdown(result["machine"]),
    ])


def _linear_section(result: dict) -> list:
    rows = result.get("linear_rows")
    if not rows:
        return []
    models = [m for m in TE_MODELS if any(r["model"] == m for r in rows)]
    grid = sorted({(r["N_c"], r["N_t"]) for r in rows})
    table = markdown_table(["N_c", "N_t"] + models + [f"{m} s" for m in models],
                           [[f"{nc:,}", f"{nt:,}"] + [_cell(rows, m, nc, nt) for m in models] +
                            [_seconds(rows, m, nc, nt) for m in models] for nc, nt in grid])
    return [f"**Beyond the chapter's grid**: the translation-equivariant models on `ae.te_attention` (no [N, N] "
            f"tensor in any attention), N_t = 1,000, a fresh process per cell, timeout "
            f"{LINEAR_TIMEOUT:,.0f} s; the last columns are each probe's wall time (model build, inputs and one "
            "prediction: TETNP's context self-attention is quadratic in time, PT-TETNP's attention linear). TETNP "
            f"stops at N_c = {LINEAR_MAX_NC['tetnp']:,}: at 100,000 one prediction would take over two hours on one "
            "thread here (25x the time at 20,000).", "",
            table, ""]


def _seconds(rows, model, nc, nt) -> Optional[str]:
    return next((f"{r['probe_seconds']:.0f}" for r in rows if r["model"] == model and r["N_c"] == nc
                 and r["N_t"] == nt), None)


def _merge_note(result: dict) -> list:
    if not result.get("remeasured_models"):
        return []
    return [f"Re-measured in this run: {', '.join(result['remeasured_models'])}; the other columns are kept from "
            f"the earlier run `{result['kept_from']}` (same probe and grid).", ""]


def plot(result: dict, path: Path) -> None:
    cfg, rows = result["config"], result["rows"]
    grid = [tuple(g) for g in cfg["grid"]]

    def series(nt):
        ncs = [nc for nc, t in grid if t == nt]
        return [Series(m, ncs, [next((r["peak_extra_mb"] for r in rows if r["model"] == m and r["N_c"] == nc
                                      and r["N_t"] == nt), None) for nc in ncs],
                       "--" if m == "tnpd_masked" else "-", "o", f"C{i % 10}")
                for i, m in enumerate(cfg["models"])]

    nts = sorted({nt for _, nt in grid})
    plot_time_and_memory(series(nts[0]), series(nts[-1]), path,
                         title=f"NP inference peak extra memory, 2-D inputs (left N_t={nts[0]}, right N_t={nts[-1]})",
                         xlabel="N_c", time_label="peak extra MB", memory_label="peak extra MB",
                         titles=(f"N_t = {nts[0]}", f"N_t = {nts[-1]}"))


def run_chapter_memory(models: Sequence[str], grid: Sequence[tuple], *, out_dir: Path, cap_mb: float = 4000.0,
                       timeout: float = 300.0, readme=None, command: str = "python -m bench run chapter_memory",
                       linear: bool = False, earlier: Optional[dict] = None) -> int:
    """Measures ``models`` on ``grid`` (and, with ``linear``, the TE models among them on :data:`LINEAR_GRID`) and
    publishes the tables. ``earlier``: a previous result (its JSON) whose other models' rows are kept."""
    machine = machine_info()
    rows = measure(models, grid, cap_mb=cap_mb, timeout=timeout)
    te_models = [m for m in models if m in TE_MODELS]
    linear_rows = [row for m in te_models if linear
                   for row in measure([m], [g for g in LINEAR_GRID if g[0] <= LINEAR_MAX_NC[m]], cap_mb=cap_mb,
                                      timeout=LINEAR_TIMEOUT)]
    machine["load_average_end"] = load_average()
    weights = {m: weights_mb(m) for m in models}
    remeasured, all_models_ = [], list(models)
    if earlier is not None:
        remeasured = list(models)
        all_models_ = list(dict.fromkeys(earlier["config"]["models"] + list(models)))
        rows = [r for r in earlier["rows"] if r["model"] not in models] + rows
        weights = {**earlier["weights_mb"], **weights}
        if not linear:
            linear_rows = [r for r in earlier.get("linear_rows", []) if r["model"] not in models]
    result = {"benchmark": NAME, "machine": machine, "rows": rows, "linear_rows": linear_rows, "command": command,
              "remeasured_models": remeasured, "kept_from": None if earlier is None else earlier["command"],
              "weights_mb": weights,
              "config": {"models": all_models_, "grid": [list(g) for g in grid], "dim_x": DIM_X, "cap_mb": cap_mb,
                         "timeout": timeout}}
    text = tables(result) + f"\n\nProduced by `{command}`, {datetime.date.today().isoformat()}."
    ok = publish(NAME, text, result, out_dir, plot, readme)
    failed = [r for r in rows if r["status"] == "failed"]
    for r in failed:
        print(f"warning: {r['model']} N_c={r['N_c']} N_t={r['N_t']}: {r['note']}", file=sys.stderr)
    return 1 if failed or not ok else 0


def run(options) -> int:
    """``python -m bench run chapter_memory`` (quick grid: two cells, the chapter's five models and CMANP)."""
    if options.quick:
        models = [m for m, _ in CHAPTER_MB.values()] + ["cmanp"]
        return run_chapter_memory(models, QUICK_GRID, out_dir=options.out_dir, timeout=120.0,
                                  command=f"{options.command} (quick grid)")
    return run_chapter_memory(all_models(), GRID, out_dir=options.out_dir, readme=options.update_readme,
                              command=f"{options.command} (full grid)", linear=True)


def earlier_result(path: Path) -> dict:
    """An earlier run's result from its ``chapter_memory.json``, or from its ``.md`` report (the committed form:
    bench/results keeps no JSON): the first table's cells, the weights table and the command."""
    import json
    import re

    text = path.read_text()
    if path.suffix == ".json":
        return json.loads(text)
    tables = [block.strip().splitlines() for block in re.split(r"\n\s*\n", text) if block.strip().startswith("|")]
    header = [c.strip() for c in tables[0][0].strip("|").split("|")]
    models, rows = header[2:], []
    for line in tables[0][2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        nc, nt = (int(c.replace(",", "")) for c in cells[:2])
        for model, status in zip(models, cells[2:]):
            mb = float(status) if re.fullmatch(r"[0-9.]+", status) else None
            rows.append({"model": model, "N_c": nc, "N_t": nt, "peak_extra_mb": mb, "status": status, "note": "",
                         "probe_seconds": None})
    weights_table = next(t for t in tables if t[0].startswith("| model | weights"))
    weights = {c[0]: float(c[1]) for c in ([x.strip() for x in line.strip("|").split("|")] for line in weights_table[2:])}
    produced = re.search(r"Produced by `([^`]*)`, ([0-9-]+)", text)
    command = f"{produced.group(1)}, {produced.group(2)}" if produced else str(path)
    return {"rows": rows, "weights_mb": weights, "command": command, "config": {"models": models}}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m bench.np.chapter_memory --models tetnp pt_tetnp --merge bench/results/chapter_memory.json``:
    re-measure some models (the chapter's grid, and the TE models beyond it) and keep the others' rows from an
    earlier result, rather than the whole grid's hour."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.np.chapter_memory", description=main.__doc__)
    parser.add_argument("--models", nargs="+", required=True, choices=all_models())
    parser.add_argument("--merge", type=Path,
                        help="an earlier chapter_memory.json or .md report whose other models are kept")
    parser.add_argument("--out", type=Path, default=Path("bench/out"))
    parser.add_argument("--no-linear", action="store_true", help="skip the TE models' grid beyond the chapter's")
    args = parser.parse_args(argv)
    earlier = earlier_result(args.merge) if args.merge else None
    command = "python -m bench.np.chapter_memory " + " ".join(sys.argv[1:] if argv is None else argv)
    return run_chapter_memory(args.models, GRID, out_dir=args.out, command=command, linear=not args.no_linear,
                              earlier=earlier)


if __name__ == "__main__":
    sys.exit(main())
