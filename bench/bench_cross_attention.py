"""``python -m bench run cross_attention``: attn_ext.cross_attention vs PyTorch SDPA on CPU.

For each key count N (B=8, H=4, M=128, D=Dv=64, fp32) it measures, in this
process and the same way for both implementations, the median wall time of the
forward and of forward+backward (see :mod:`.cross_attention_workload`; repeats
of the two implementations interleaved so background load hits both alike), and, in
a fresh subprocess per (implementation, N), the peak extra memory of one forward
(see :mod:`.memory`). It then checks the memory method on SDPA's math path,
whose score matrix has a known size.

Writes ``cross_attention.{md,json,png}`` to the output directory and prints the
Markdown tables to stdout; progress goes to stderr, one line per measurement.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

from bench.harness import BenchOptions
from bench import cross_attention_workload as wl
from bench.harness.machine import load_average, machine_info, machine_markdown
from bench.harness.memory import PeakMemory, measure_peak_extra
from bench.harness.plot import Series, plot_time_and_memory
from bench.harness.report import format_ms, markdown_table, progress, update_readme
from bench.harness.timing import WARMUP_TEXT, time_interleaved

NAME = "cross_attention"
_PROBE = "bench.cross_attention_workload:memory_probe"
#: The math path must show at least this share of its score matrix, or the method is off.
_CHECK_MIN_SHARE = 0.95
#: Large enough that the scores (164 MB) dwarf allocator noise, small enough to take seconds
#: (at N=1e5 the math path needs 3.7 GB and ~40 s here).
_CHECK_N = 10_000


def _fmt(x: float | None, spec: str) -> str | None:
    return None if x is None else format(x, spec)


def _memory_dict(n: int, impl: str, mem: PeakMemory) -> dict:
    return {"N": n, "impl": impl, "peak_extra_mb": mem.mb, "method": mem.method, "note": mem.note}


def _measure(options: BenchOptions, ns: tuple[int, ...]) -> tuple[list[dict], list[dict], dict]:
    """Time and memory-probe every (N, impl, pass); then check the memory method."""
    total = len(ns) * (len(wl.IMPLS) * len(wl.PASSES) + len(wl.IMPLS)) + 1
    step = 0
    timings: list[dict] = []
    memory: list[dict] = []
    fns = {impl: wl.implementation(impl, options.backend) for impl in wl.IMPLS}
    for n in ns:
        q, k, v = wl.make_inputs(n)
        for pass_ in wl.PASSES:
            labels = {impl: wl.impl_label(impl, options.backend) for impl in wl.IMPLS}
            # Announce the first line now; results arrive together since the repeats interleave.
            progress(f"[{step + 1}/{total}] N={n} {labels[wl.IMPLS[0]]} {pass_} ...", end="")
            calls = {impl: wl.make_call(fns[impl], pass_, q, k, v) for impl in wl.IMPLS}
            measured = time_interleaved(calls, repeats=options.repeats)
            for i, impl in enumerate(wl.IMPLS):
                step += 1
                if i:
                    progress(f"[{step}/{total}] N={n} {labels[impl]} {pass_} ...", end="")
                entry = {"N": n, "impl": impl, "pass": pass_, "flops": wl.flops(n, pass_)}
                t = measured[impl]
                if isinstance(t, Exception):
                    entry.update(median_ms=None, samples_ms=[], gflops=None, error=f"{type(t).__name__}: {t}")
                    progress(f" failed: {entry['error']}")
                else:
                    gflops = wl.flops(n, pass_) / (t.median_ms * 1e-3) / 1e9
                    entry.update(median_ms=t.median_ms, samples_ms=list(t.samples_ms), gflops=gflops)
                    progress(f" {t.median_ms:.1f} ms ({gflops:.1f} GFLOP/s)")
                timings.append(entry)
        # Free this N's inputs (the calls' closures and any exception tracebacks hold them
        # too) before the probes, so two copies never coexist on the machine.
        del q, k, v, calls, measured
        gc.collect()
        for impl in wl.IMPLS:
            step += 1
            label = wl.impl_label(impl, options.backend)
            progress(f"[{step}/{total}] N={n} {label} fwd peak extra memory ...", end="")
            mem = measure_peak_extra(_PROBE, {"impl": impl, "n": n, "backend": options.backend})
            progress(f" {mem.mb:.1f} MB ({mem.method})" if mem.mb is not None else f" n/a ({mem.note})")
            memory.append(_memory_dict(n, impl, mem))
    step += 1
    progress(f"[{step}/{total}] memory method check ...", end="")
    check = _check_memory_method(_CHECK_N)
    progress(f" {check['summary']}")
    return timings, memory, check


def _check_memory_method(n: int) -> dict:
    """Probe SDPA's math path, whose fp32 scores alone take B*H*M*N*4 bytes."""
    mem = measure_peak_extra(_PROBE, {"impl": "sdpa-math", "n": n})
    expected_mb = wl.score_bytes(n) / 1e6
    if mem.mb is None:
        ok, summary = None, f"n/a ({mem.note})"
    else:
        ok = mem.mb >= _CHECK_MIN_SHARE * expected_mb
        summary = (
            f"SDPA math path at N={n}: peak extra {mem.mb:.1f} MB ({mem.method}); one [B,H,M,N] fp32 "
            f"score matrix is {expected_mb:.1f} MB -> {'consistent' if ok else 'INCONSISTENT'}"
        )
    return {**_memory_dict(n, "sdpa-math", mem), "expected_min_mb": expected_mb, "ok": ok, "summary": summary}


def _tables(result: dict) -> str:
    """Markdown block: shapes, time table, memory table, machine line."""
    backend = result["config"]["backend"]
    ours = f"attn_ext ({backend})"
    by_key = {(t["N"], t["impl"], t["pass"]): t for t in result["timings"]}
    time_rows = []
    for n in result["config"]["Ns"]:
        for pass_ in wl.PASSES:
            a, s = by_key[(n, "ours", pass_)], by_key[(n, "sdpa", pass_)]
            ratio = a["median_ms"] / s["median_ms"] if a["median_ms"] and s["median_ms"] else None
            time_rows.append([
                f"{n:,}", pass_, format_ms(a["median_ms"]), format_ms(s["median_ms"]),
                _fmt(ratio, ".2f"), _fmt(a["gflops"], ".1f"), _fmt(s["gflops"], ".1f"),
            ])
    mem = {(m["N"], m["impl"]): m for m in result["memory"]}
    mem_rows = [
        [f"{n:,}", f"{wl.input_bytes(n) / 1e6:.1f}",
         _fmt(mem[(n, "ours")]["peak_extra_mb"], ".1f"), _fmt(mem[(n, "sdpa")]["peak_extra_mb"], ".1f")]
        for n in result["config"]["Ns"]
    ]
    cfg = result["config"]
    lines = [
        f"Cross attention, B={cfg['B']}, H={cfg['H']}, M={cfg['M']}, D=Dv={cfg['D']}, {cfg['dtype']}, CPU; "
        f"median of {cfg['repeats']} repeats after {WARMUP_TEXT}, the two implementations' repeats interleaved; "
        f"SDPA kernel: {result['sdpa_kernel']}.",
        "",
        markdown_table(
            ["N (keys)", "pass", f"{ours} ms", "SDPA ms", f"{ours} / SDPA",
             f"{ours} GFLOP/s", "SDPA GFLOP/s"],
            time_rows, align="lcrrrrr",
        ),
        "",
        "GFLOP/s counts 4·B·H·M·N·D flops for fwd (QKᵀ, PV) and 14·B·H·M·N·D for fwd+bwd "
        "(4 forward + 10 backward: recomputed QKᵀ, dO·Vᵀ, Pᵀ·dO, dS·K, dSᵀ·Q).",
        "",
        markdown_table(
            ["N (keys)", "K+V inputs MB", f"{ours} fwd peak extra MB", "SDPA fwd peak extra MB"],
            mem_rows,
        ),
        "",
        "Peak extra memory = peak RSS during one forward minus RSS before it, in a fresh process "
        "(inputs excluded, output included; MB = 10⁶ bytes). "
        f"Method check: {result['memory_check']['summary']}.",
        "",
        machine_markdown(result["machine"]),
    ]
    return "\n".join(lines)


def _plot(result: dict, path: Path) -> None:
    ns = result["config"]["Ns"]
    backend = result["config"]["backend"]
    by_key = {(t["N"], t["impl"], t["pass"]): t["median_ms"] for t in result["timings"]}
    mem = {(m["N"], m["impl"]): m["peak_extra_mb"] for m in result["memory"]}
    names = {"ours": f"attn_ext ({backend})", "sdpa": "SDPA"}
    styles = {"ours": ("-", "C0"), "sdpa": ("--", "C1")}
    time_series = [
        Series(f"{names[i]} {p}", ns, [by_key[(n, i, p)] for n in ns], styles[i][0],
               "o" if p == "fwd" else "s", styles[i][1])
        for i in wl.IMPLS for p in wl.PASSES
    ]
    memory_series = [
        Series(f"{names[i]} fwd", ns, [mem[(n, i)] for n in ns], styles[i][0], "o", styles[i][1])
        for i in wl.IMPLS
    ]
    # The inputs' size gives the flat memory lines a scale to be read against.
    memory_series.append(Series("K+V inputs (for scale)", ns, [wl.input_bytes(n) / 1e6 for n in ns], ":", "", "0.5"))
    cfg = result["config"]
    plot_time_and_memory(
        time_series, memory_series, path, xlabel="N (keys)",
        title=f"cross attention, B={cfg['B']} H={cfg['H']} M={cfg['M']} D={cfg['D']} fp32, "
              f"{result['machine']['torch_threads']} threads",
        memory_label="peak extra memory of one forward (MB)",
    )


def _write_outputs(result: dict, block: str, out_dir: Path) -> None:
    """Write ``cross_attention.{md,json,png}`` into ``out_dir`` (created if needed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{NAME}.md").write_text(f"# {NAME} benchmark\n\n{block}\n", encoding="utf-8")
    (out_dir / f"{NAME}.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    try:
        _plot(result, out_dir / f"{NAME}.png")
    except ImportError as exc:  # matplotlib is a dev extra; the numbers matter more than the figure
        progress(f"warning: no {NAME}.png ({exc})")
    progress(f"wrote {out_dir / NAME}.md, .json, .png")


def run(options: BenchOptions) -> int:
    """Run the benchmark; see the module docstring.

    Returns
    -------
    int
        0 on success; 2 when ``attn_ext.cross_attention`` cannot run with the
        requested backend (nothing is timed then); 1 when a measurement failed
        or the README could not be updated (results are still written).
    """
    error, warning = wl.check_ours(options.backend)
    if error:
        progress(f"error: {error}")
        return 2
    if warning:
        progress(f"warning: {warning}")
    ns = wl.QUICK_NS if options.quick else wl.FULL_NS
    machine = machine_info()
    progress(f"cross_attention benchmark: N in {list(ns)}, backend={options.backend}, "
         f"repeats={options.repeats}; {machine_markdown(machine)}")
    timings, memory, check = _measure(options, ns)
    machine["load_average_end"] = load_average()
    result = {
        "benchmark": NAME,
        "config": {"B": wl.B, "H": wl.H, "M": wl.M, "D": wl.D, "Dv": wl.DV, "dtype": "fp32",
                   "device": "cpu", "Ns": list(ns), "repeats": options.repeats, "warmup": 1,
                   "backend": options.backend, "quick": options.quick},
        "flop_factor_per_BHMND": dict(wl.FLOP_FACTOR),
        "sdpa_kernel": wl.sdpa_kernel_name(),
        "machine": machine,
        "timings": timings,
        "memory": memory,
        "memory_check": check,
        "warnings": [w for w in (warning,) if w],
    }
    if check["ok"] is False:
        result["warnings"].append(f"memory method check failed: {check['summary']}")
    failed = [t for t in timings if t.get("error")]
    result["warnings"] += [
        f"N={t['N']} {wl.impl_label(t['impl'], options.backend)} {t['pass']} failed: {t['error']}" for t in failed
    ]
    # Warnings go into the block itself, so a README never shows a table without them.
    block = _tables(result) + "".join(f"\n\nWarning: {w}" for w in result["warnings"])
    print(block)
    _write_outputs(result, block, Path(options.out_dir))
    if options.update_readme is not None:
        try:
            update_readme(options.update_readme, NAME, block)
        except (OSError, ValueError) as exc:
            progress(f"error: could not update {options.update_readme}: {exc}")
            return 1
        progress(f"updated the {NAME} block of {options.update_readme}")
    return 1 if failed else 0
