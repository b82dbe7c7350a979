"""``python -m bench memory`` (and ``python -m bench run np_memory``): peak inference memory of the NP models.

For each model (docs/spec.md §5 default sizes, random weights, eval mode, no autograd, batch 1, fp32) and
each context size ``N_c`` at fixed ``N_t`` (then each ``N_t`` at fixed ``N_c``), one fresh
subprocess builds the model and the inputs and measures the peak extra RSS of one prediction
(:mod:`bench.harness.memory`; inputs and weights are the baseline, the output counts). CMANP and
CMANP-AND condition on the context in chunks of ``--chunk-size`` points; CMANP-AND is measured
drawing a block-autoregressive sample (``b_Q`` = 5). ``tnpd_masked`` is TNP-D as officially
formulated — masked self attention over all ``N_c + N_t`` tokens with ``scaled_dot_product_attention``
and a ``[N, N]`` mask — on the same weights, for the quadratic reference.

A cell whose allocation exceeds ``--cap-mb`` (an ``RLIMIT_DATA`` set in the child) is reported as
``> cap``, one exceeding ``--timeout`` seconds as ``timeout``; neither stops the sweep.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from attn_ext.models import build_model
from bench.harness.goals import verdict
from bench.harness.machine import load_average, machine_info, machine_markdown
from bench.harness.memory import measure_peak_extra
from bench.harness.plot import Series, plot_time_and_memory
from bench.harness.report import markdown_table, progress, publish

NAME = "np_memory"
MODEL_NAMES = ("tnpd", "tnpd_masked", "lbanp", "cmanp", "cmanp_and", "retreever", "intention_np", "linear_tnp",
               "tnp_nd", "lbanp_nd")
FULL_NC: tuple = (10, 100, 1_000, 5_000, 20_000, 100_000)
QUICK_NC: tuple = (1_000, 10_000)
FULL_NT: tuple = (10, 100, 1_000, 10_000)
QUICK_NT: tuple = (100, 1_000)
#: ``python -m bench run --quick`` measures only the models of the issue's memory goals.
QUICK_MODELS: tuple = ("tnpd", "tnpd_masked", "lbanp", "cmanp")
FIXED_NT, FIXED_NC = 100, 1_000
#: CMANP's goal: peak at N_c = 1e5 at most this many times its peak at N_c = 1e3.
FLAT_MAX_RATIO = 1.1
_PROBE = "bench.np.np_memory:memory_probe"
#: Models whose N_c sweep is repeated counting tensor allocations only (torch.profiler): their peaks
#: are ~1 MB, where RSS moves by a few hundred kB with the heap's fragmentation.
PROFILER_MODELS = ("cmanp", "cmanp_and")
TENSORS = "N_c, tensors"


def _vm_data_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise OSError("VmData missing from /proc/self/status")


def _masked_tnpd(model, xc, yc, xt):
    """TNP-D's official formulation on ``model``'s weights: a ``[N, N]`` mask and SDPA per layer (the
    attention module's public parameters, laid out as ``torch.nn.MultiheadAttention``'s)."""
    tokens = torch.cat([model.embed_pairs(xc, yc), model.embed_pairs(xt, None)], 1)
    n, nc = tokens.shape[1], xc.shape[1]
    allowed = torch.zeros(n, n, dtype=torch.bool)
    allowed[:, :nc] = True  # everyone attends to the context only
    for layer in model.encoder.layers:
        mha = layer.attention.attention
        weights = (mha.in_proj_weight.chunk(3) if mha.in_proj_weight is not None
                   else (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight))
        biases = (None,) * 3 if mha.in_proj_bias is None else mha.in_proj_bias.chunk(3)
        h = layer.norm(tokens)
        q, k, v = (F.linear(h, w, b).unflatten(-1, (mha.num_heads, mha.head_dim)).transpose(1, 2)
                   for w, b in zip(weights, biases))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        tokens = tokens + mha.out_proj(out.transpose(1, 2).flatten(2))
        tokens = tokens + layer.ff(layer.norm_ff(tokens))
    return model.head(model.encoder.norm(tokens)[:, nc:])


def memory_probe(model: str, n_context: int, n_target: int, chunk_size: int = 1024,
                 cap_mb: Optional[float] = None, seed: int = 0, dim_x: int = 1) -> Callable[[], object]:
    """Target of :func:`bench.harness.memory.measure_peak_extra`: builds the model (inputs of ``dim_x``
    dimensions in [−2, 2)) and the inputs, caps further allocations at ``cap_mb`` MB, returns the
    prediction to measure."""
    torch.manual_seed(seed)
    base = "tnpd" if model == "tnpd_masked" else model
    net = build_model(base, chunk_size=chunk_size, dim_x=dim_x).eval()
    xc, xt = torch.rand(1, n_context, dim_x) * 4 - 2, torch.rand(1, n_target, dim_x) * 4 - 2
    yc = torch.sin(3 * xc).sum(-1, keepdim=True)
    if cap_mb is not None:
        limit = _vm_data_bytes() + int(cap_mb * 1e6)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))

    def call():
        with torch.no_grad():
            if model == "tnpd_masked":
                return _masked_tnpd(net, xc, yc, xt).mean
            if model == "cmanp_and":
                return net.sample(xc, yc, xt, generator=torch.Generator().manual_seed(1))
            return net.predict(xc, yc, xt).mean

    return call


def _status(mem, elapsed: float, timeout: float) -> str:
    """How a cell reads: MB, ``> cap`` or ``timeout`` (or ``failed``)."""
    if mem.mb is not None:
        return f"{mem.mb:.1f}"
    note = mem.note.lower()
    if "allocate" in note or "memoryerror" in note or "out of memory" in note or "not enough memory" in note:
        return "> cap"
    if "timed out" in note or elapsed >= timeout:
        return "timeout"
    return "failed"


def measure(models: Sequence[str], ncs: Sequence[int], nts: Sequence[int], *, fixed_nt: int = FIXED_NT,
            fixed_nc: int = FIXED_NC, chunk_size: int = 1024, cap_mb: float = 4000.0,
            timeout: float = 600.0, log=None) -> list:
    """One fresh-process probe per (model, sweep, N); returns the rows."""
    log = log or progress
    cells = ([("N_c", m, n, fixed_nt) for m in models for n in ncs]
             + [("N_t", m, fixed_nc, n) for m in models for n in nts]
             + [(TENSORS, m, n, fixed_nt) for m in models if m in PROFILER_MODELS for n in ncs])
    rows = []
    for i, (sweep, model, nc, nt) in enumerate(cells, 1):
        log(f"[{i}/{len(cells)}] {model} N_c={nc:,} N_t={nt:,}{' (profiler)' if sweep == TENSORS else ''} ...", end="")
        start = time.perf_counter()
        mem = measure_peak_extra(_PROBE, {"model": model, "n_context": nc, "n_target": nt, "chunk_size": chunk_size,
                                          "cap_mb": cap_mb}, timeout=timeout,
                                 method="profiler" if sweep == TENSORS else "auto")
        elapsed = time.perf_counter() - start
        status = _status(mem, elapsed, timeout)
        log(f" {status} ({elapsed:.0f} s)")
        rows.append({"sweep": sweep, "model": model, "N_c": nc, "N_t": nt, "peak_extra_mb": mem.mb,
                     "status": status, "note": mem.note, "probe_seconds": round(elapsed, 1)})
    return rows


def _peak(rows, sweep, model, n):
    key = "N_t" if sweep == "N_t" else "N_c"
    for r in rows:
        if r["sweep"] == sweep and r["model"] == model and r[key] == n:
            return r
    return None


def goals(rows: list, models: Sequence[str], ncs: Sequence[int]) -> dict:
    """CMANP's flatness (peak at the largest N_c / at N_c = 1e3, or the smallest ≥ 1e3) and the
    log-log slope of every model between its two largest measured N_c."""
    out = {"flat_max_ratio": FLAT_MAX_RATIO, "slopes": {}}
    for m in models:
        pts = [(n, _peak(rows, "N_c", m, n)["peak_extra_mb"]) for n in ncs if _peak(rows, "N_c", m, n)]
        pts = [(n, p) for n, p in pts if p]
        if len(pts) >= 2:
            (n0, p0), (n1, p1) = pts[-2], pts[-1]
            out["slopes"][m] = round(math.log(p1 / p0) / math.log(n1 / n0), 2)
    ref = next((n for n in ncs if n >= 1_000), None)
    for m in PROFILER_MODELS:
        for sweep, suffix in (("N_c", "ratio"), (TENSORS, "tensor_ratio")):
            lo, hi = _peak(rows, sweep, m, ref) if ref else None, _peak(rows, sweep, m, max(ncs))
            ok = lo and hi and lo["peak_extra_mb"] and hi["peak_extra_mb"]
            ratio = hi["peak_extra_mb"] / lo["peak_extra_mb"] if ok else None
            out[f"{m}_{suffix}"] = {"from": ref, "to": max(ncs), "ratio": ratio,
                                    "flat": None if ratio is None else ratio <= FLAT_MAX_RATIO}
    return out


def tables(result: dict) -> str:
    cfg, rows, g = result["config"], result["rows"], result["goals"]

    def table(sweep, ns, label):
        body = [[m] + [(_peak(rows, sweep, m, n) or {}).get("status") for n in ns] for m in cfg["models"]]
        return markdown_table([f"model \\ {label}"] + [f"{n:,}" for n in ns], body)

    slope = ", ".join(f"{m} {s}" for m, s in g["slopes"].items())
    profiled = [m for m in cfg["models"] if m in PROFILER_MODELS]
    tensor_table = [] if not profiled else [
        f"**vs N_c, tensor allocations only** (torch.profiler, N_t = {cfg['fixed_nt']:,}; MB). CMANP(-AND) peak "
        "at about 1 MB, where RSS moves by a few hundred kB from run to run (heap fragmentation, page "
        "granularity); this sweep is the reliable flatness figure.", "",
        markdown_table(["model \\ N_c"] + [f"{n:,}" for n in cfg["ncs"]],
                       [[m] + [(_peak(rows, TENSORS, m, n) or {}).get("status") for n in cfg["ncs"]] for m in profiled]),
        ""]
    lines = [
        f"Peak extra memory (MB) of one prediction, batch 1, fp32, CPU, docs/spec.md §5 sizes (d_model 64, 6 layers, "
        f"4 heads, CMANP/LBANP 128 latents), random weights, no autograd; a fresh process per cell. CMANP(-AND) "
        f"condition in chunks of {cfg['chunk_size']} points; CMANP-AND draws a block-autoregressive sample (b_Q = 5). "
        f"`tnpd_masked` = TNP-D's official masked formulation (SDPA with an [N, N] mask) on the same weights; "
        f"`tnpd` = TNP-D on attn_ext's fused cross attention (no [N, N] matrix). `> cap`: more than "
        f"{cfg['cap_mb']:,.0f} MB; `timeout`: over {cfg['timeout']:.0f} s.",
        "",
        f"**vs N_c** (N_t = {cfg['fixed_nt']:,})",
        "",
        table("N_c", cfg["ncs"], "N_c"),
        "",
        f"**vs N_t** (N_c = {cfg['fixed_nc']:,})",
        "",
        table("N_t", cfg["nts"], "N_t"),
        "",
        *tensor_table,
        _goal_line(result) + " "
        f"Log-log slope between the two largest measured N_c (1 = linear, 2 = quadratic, 0 = flat): {slope}.",
        "",
        machine_markdown(result["machine"]),
    ]
    return "\n".join(lines)


def _goal_line(result: dict) -> str:
    g = result["goals"]
    cm, ct = g["cmanp_ratio"], g.get("cmanp_tensor_ratio", {"ratio": None, "flat": None})

    def fmt(r):
        return "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}"

    if cm["from"] is None:
        return "Goal, CMANP flat in N_c: **not measured** (the sweep needs N_c >= 1,000)."
    return (f"Goal, CMANP flat in N_c: peak at N_c = {cm['to']:,} / at N_c = {cm['from']:,} (<= {FLAT_MAX_RATIO}): "
            f"RSS {fmt(cm)} (**{verdict(cm['flat'])}**), tensor allocations {fmt(ct)} (**{verdict(ct['flat'])}**).")


def summary(result: dict) -> str:
    """The README's short form: the N_c sweep of the goals' models and the goal (all models, the N_t sweep
    and more in ``<name>.md``)."""
    cfg, rows = result["config"], result["rows"]
    models = [m for m in cfg["models"] if m in QUICK_MODELS] or cfg["models"]
    body = [[m] + [(_peak(rows, "N_c", m, n) or {}).get("status") for n in cfg["ncs"]] for m in models]
    return "\n".join([
        f"Peak extra memory (MB) of one prediction vs N_c (N_t = {cfg['fixed_nt']:,}), batch 1, fp32, docs/spec.md §5 sizes, "
        "random weights, a fresh process per cell. `tnpd_masked` = TNP-D's official masked formulation (SDPA with an "
        f"[N, N] mask), `tnpd` = the same weights on `ae.cross_attention`. `> cap`: over {cfg['cap_mb']:,.0f} MB; "
        f"`timeout`: over {cfg['timeout']:.0f} s. The other models in the full report.",
        "",
        markdown_table(["model \\ N_c"] + [f"{n:,}" for n in cfg["ncs"]], body),
        "",
        _goal_line(result),
    ])


def plot(result: dict, path: Path) -> None:
    cfg, rows = result["config"], result["rows"]

    def series(sweep, ns):
        return [Series(m, ns, [(_peak(rows, sweep, m, n) or {}).get("peak_extra_mb") for n in ns],
                       "--" if m == "tnpd_masked" else "-", "o", f"C{i}") for i, m in enumerate(cfg["models"])]

    plot_time_and_memory(series("N_c", cfg["ncs"]), series("N_t", cfg["nts"]), path,
                         title=f"NP inference peak memory (left: vs N_c at N_t={cfg['fixed_nt']}; "
                               f"right: vs N_t at N_c={cfg['fixed_nc']})",
                         xlabel="N_c (left) / N_t (right)", time_label="peak extra MB vs N_c",
                         memory_label="peak extra MB vs N_t", titles=("vs N_c", "vs N_t"))


def run_memory(models, ncs, nts, *, out_dir: Path, fixed_nt=FIXED_NT, fixed_nc=FIXED_NC, chunk_size=1024,
               cap_mb=4000.0, timeout=600.0, readme=None, name=NAME, reuse: Optional[Path] = None,
               command: str = "python -m bench memory") -> int:
    """Measure, then write ``<name>.md/.json/.png`` to ``out_dir`` (and the README block).

    ``reuse``: a previous ``<name>.json`` whose rows of models not in ``models`` are kept (same grid),
    to re-measure some models without repeating the others. ``command`` is named in the report.
    """
    machine = machine_info()
    rows = measure(models, ncs, nts, fixed_nt=fixed_nt, fixed_nc=fixed_nc, chunk_size=chunk_size, cap_mb=cap_mb,
                   timeout=timeout)
    machine["load_average_end"] = load_average()
    if reuse is not None:
        old = json.loads(Path(reuse).read_text())
        kept = [m for m in old["config"]["models"] if m not in models]
        rows = [r for r in old["rows"] if r["model"] in kept] + rows
        models = [m for m in old["config"]["models"] if m in kept or m in models] + \
            [m for m in models if m not in old["config"]["models"]]
    result = {"benchmark": name, "machine": machine, "rows": rows, "goals": goals(rows, models, ncs),
              "config": {"models": list(models), "ncs": list(ncs), "nts": list(nts), "fixed_nt": fixed_nt,
                         "fixed_nc": fixed_nc, "chunk_size": chunk_size, "cap_mb": cap_mb, "timeout": timeout}}
    result["command"] = command
    text = tables(result) + f"\n\nProduced by `{command}`, {datetime.date.today().isoformat()}."
    ok = publish(name, text, result, out_dir, plot, readme,
                 summary=summary(result) + f"\n\nProduced by `{command}`, {datetime.date.today().isoformat()}.")
    failed = [r for r in rows if r["status"] == "failed"]
    for r in failed:
        print(f"warning: {r['model']} N_c={r['N_c']} N_t={r['N_t']}: {r['note']}", file=sys.stderr)
    return 1 if failed or not ok else 0


def run(options) -> int:
    """``python -m bench run np_memory``: the sweep at the quick or full sizes."""
    ncs, nts = (QUICK_NC, QUICK_NT) if options.quick else (FULL_NC, FULL_NT)
    return run_memory(QUICK_MODELS if options.quick else MODEL_NAMES, ncs, nts, out_dir=options.out_dir,
                      timeout=120.0 if options.quick else 600.0, readme=options.update_readme,
                      command=f"{options.command} ({options.grid} grid)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", choices=MODEL_NAMES, default=list(MODEL_NAMES), metavar="MODEL",
                        help=f"models to measure (default: all of {', '.join(MODEL_NAMES)})")
    parser.add_argument("--nc", nargs="+", type=int, default=None, help=f"context sizes (default {FULL_NC})")
    parser.add_argument("--nt", nargs="+", type=int, default=None, help=f"target sizes (default {FULL_NT})")
    parser.add_argument("--fixed-nt", type=int, default=FIXED_NT, help="N_t of the N_c sweep")
    parser.add_argument("--fixed-nc", type=int, default=FIXED_NC, help="N_c of the N_t sweep")
    parser.add_argument("--chunk-size", type=int, default=1024, help="context points per chunk (CMANP)")
    parser.add_argument("--cap-mb", type=float, default=4000.0, help="memory cap per cell (MB)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per cell")
    parser.add_argument("--quick", action="store_true", help=f"N_c {QUICK_NC}, N_t {QUICK_NT}")
    parser.add_argument("--out", type=Path, default=Path("bench/out"),
                        help="output directory (default bench/out, git-ignored; bench/results holds the committed run)")
    parser.add_argument("--name", default=NAME, help="file stem of the results")
    parser.add_argument("--update-readme", type=Path, default=None)
    parser.add_argument("--reuse", type=Path, default=None, metavar="JSON",
                        help="keep the rows of the other models from this earlier np_memory.json (same grid)")


def run_cli(args: argparse.Namespace) -> int:
    ncs = args.nc or (QUICK_NC if args.quick else FULL_NC)
    nts = args.nt or (QUICK_NT if args.quick else FULL_NT)
    return run_memory(args.models, ncs, nts, out_dir=args.out, fixed_nt=args.fixed_nt, fixed_nc=args.fixed_nc,
                      chunk_size=args.chunk_size, cap_mb=args.cap_mb, timeout=args.timeout,
                      readme=args.update_readme, name=args.name, reuse=args.reuse,
                      command=" ".join(["python -m bench", *getattr(args, "argv", ["memory"])]))
