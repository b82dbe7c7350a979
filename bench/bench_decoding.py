"""``python -m bench run decoding``: one new query over a long key set (decoding with a cache), on the CPU.

``ae.scaled_dot_product_attention`` against PyTorch's SDPA on ``q [1, 8, 1, 128]`` over ``N`` keys and values
(fp32; the full grid's N = 10⁶ holds 8 GiB of keys and values, the quick grid's 10⁵), timed in this process with
the samples interleaved. The work is a pass over the keys and values (memory-bound): the cpp kernels give each
thread whole heads, or split the keys of each head into parts merged exactly when the heads are fewer than the
threads, so both cores read. The threads' busy share is reported from the process's CPU time over the wall time
of the calls.

Goal (issue 44, full grid): ours / SDPA ≤ :data:`MAX_RATIO`. Writes ``decoding.{md,json}``.
"""

from __future__ import annotations

import resource
import time

import torch

import attn_ext as ae
from bench.harness import BenchOptions
from bench.harness.goals import confirm, grid_note
from bench.harness.machine import machine_info, machine_markdown
from bench.harness.report import format_ms, markdown_table, progress, publish_run, timing_dict
from bench.harness.timing import median_ms, time_interleaved

NAME = "decoding"
B, H, M, D = 1, 8, 1, 128
FULL_N, QUICK_N = 1_000_000, 100_000
MAX_RATIO = 1.0


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def busy_threads(fn, calls: int = 3) -> float:
    """Average number of busy threads over ``calls`` calls of ``fn``: process CPU time / wall time."""
    cpu, wall = _cpu_seconds(), time.perf_counter()
    for _ in range(calls):
        fn()
    return (_cpu_seconds() - cpu) / max(time.perf_counter() - wall, 1e-9)


def measure(n: int, backend: str, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, M, D, generator=gen)
    k = torch.randn(B, H, n, D, generator=gen)
    v = torch.randn(B, H, n, D, generator=gen)
    ours = lambda: ae.scaled_dot_product_attention(q, k, v, backend=backend)  # noqa: E731
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
    diff = float((ours() - sdpa()).abs().max())
    timings = time_interleaved({"ours": ours, "sdpa": sdpa}, repeats=repeats, warmup=1)
    a, b = median_ms(timings["ours"]), median_ms(timings["sdpa"])
    return {"n": n, "ours": timing_dict(timings["ours"]), "sdpa": timing_dict(timings["sdpa"]),
            "ratio": None if a is None or b is None else a / b, "busy_threads": busy_threads(ours), "max_diff": diff}


def _tables(result: dict) -> str:
    r = result["row"]
    rows = [[f"{r['n']:,}", format_ms(r["ours"]["median_ms"]), format_ms(r["sdpa"]["median_ms"]),
             "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x", f"{r['busy_threads']:.2f}",
             result["verdict"]]]
    note = result["grid_note"].strip().strip("()").capitalize()
    return (f"Decoding: one query over N keys, B = {B}, H = {H}, D = {D}, fp32, backend `{result['backend']}`; "
            f"{result['machine_text']}\n\n"
            + markdown_table(["N", "ours ms", "SDPA ms", "ours / SDPA", "busy threads (ours)",
                              f"goal ≤ {MAX_RATIO:g}"], rows)
            + (f"\n\n{note}." if note else "") + f"\n\nMax abs difference to SDPA: {r['max_diff']:.2e}.")


def _summary(result: dict) -> tuple:
    r = result["row"]
    table = markdown_table(["N", "ours / SDPA", "busy threads", f"goal ≤ {MAX_RATIO:g}"],
                           [[f"{r['n']:,}", "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x",
                             f"{r['busy_threads']:.2f}", result["verdict"]]])
    return table, (f"`ae.scaled_dot_product_attention` for one new query over N cached keys (B = {B}, H = {H}, "
                   f"D = {D}, fp32, `{result['backend']}`, 2 threads) / PyTorch's SDPA.")


def run(options: BenchOptions) -> int:
    n = QUICK_N if options.quick else FULL_N
    machine = machine_info()
    progress(f"{NAME} benchmark ({options.grid} grid): N = {n:,}, backend={options.backend}; {machine_markdown(machine)}")
    row = measure(n, options.backend, options.repeats)
    verdict = "not judged"
    if n == FULL_N:
        verdict = confirm(row["ratio"], MAX_RATIO, False,
                          lambda: measure(n, options.backend, options.repeats)["ratio"], "ours / SDPA",
                          log=progress)["verdict"]
    warnings = [] if row["max_diff"] <= 1e-4 else [f"ours differs from SDPA by {row['max_diff']:.3g}"]
    result = {"row": row, "verdict": verdict, "backend": options.backend, "machine": machine,
              "machine_text": machine_markdown(machine), "warnings": warnings,
              "grid_note": grid_note(options.quick, f"N = {FULL_N:,}", None if options.quick else f"N = {FULL_N:,}")}
    return publish_run(NAME, result, _tables, _summary, options)
