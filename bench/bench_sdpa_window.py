"""``python -m bench run sdpa_window``: a sliding window against the full causal rule, on the CPU.

``ae.scaled_dot_product_attention(q, k, v, is_causal=True, window_size=(W, 0))`` (each query sees itself and the
``W`` keys before it) against the same call without the window, L = S, B = 1, H = 8, D = 64, fp32, forward and
forward+backward, timed in this process with the samples interleaved. The kernels skip the key chunks outside
every query's band, so the window's cost grows with ``L · W`` and the full causal call's with ``L² / 2``.

Goal (issue 44, full grid, L = 16384, W = 256): window / causal ≤ :data:`MAX_WINDOW_RATIO`, forward and
forward+backward. The quick grid (``make bench``) runs L = 4096, where the same ratio is expected about four
times larger (the causal call is a quarter of the work), so it reports the ratio without judging it.
Before timing, the window's output and gradients are checked against PyTorch's SDPA with the band as a bool
mask. Writes ``sdpa_window.{md,json,png}``.
"""

from __future__ import annotations

import torch

import attn_ext as ae
from bench.harness import BenchOptions
from bench.harness.calls import PASSES, make_call
from bench.harness.goals import confirm, grid_note
from bench.harness.machine import machine_info, machine_markdown
from bench.harness.plot import plot_pass_bars
from bench.harness.report import format_ms, markdown_table, progress, publish_run, timing_dict
from bench.harness.timing import median_ms, time_interleaved

NAME = "sdpa_window"
B, H, D = 1, 8, 64
WINDOW = 256
FULL_L, QUICK_L = 16384, 4096
#: Goal: window time / full causal time at FULL_L, forward and forward+backward.
MAX_WINDOW_RATIO = 0.1
#: Max abs difference to SDPA with the band as a mask (fp32, order-1 values) before the report warns.
CHECK_ATOL = 1e-4


def band(length: int, window: int) -> torch.Tensor:
    """Bool ``[L, L]``: query i sees keys i - window .. i."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    return (j <= i) & (j >= i - window)


def check(backend: str, length: int = 300, window: int = 37) -> float:
    """Max abs difference of the window's output and gradients to SDPA with the band as a bool mask."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, length, D, generator=gen).requires_grad_() for _ in range(3))
    ours = ae.scaled_dot_product_attention(q, k, v, is_causal=True, window_size=(window, 0), backend=backend)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band(length, window))
    g = torch.randn(ours.shape, generator=gen)
    diffs = [(ours - theirs).abs().max()]
    diffs += [(a - b).abs().max() for a, b in zip(torch.autograd.grad(ours, (q, k, v), g),
                                                  torch.autograd.grad(theirs, (q, k, v), g))]
    return float(max(diffs))


def measure(length: int, backend: str, repeats: int) -> dict:
    """``{pass: {"window": timing, "causal": timing, "ratio": window / causal}}`` at ``length``."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, length, D, generator=gen) for _ in range(3))
    fns = {"window": lambda q, k, v: ae.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                      window_size=(WINDOW, 0), backend=backend),
           "causal": lambda q, k, v: ae.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)}
    out = {}
    for pass_ in PASSES:
        progress(f"  L = {length}, {pass_} ...")
        timings = time_interleaved({name: make_call(fn, pass_, q, k, v) for name, fn in fns.items()},
                                   repeats=repeats, warmup=1)
        window, causal = median_ms(timings["window"]), median_ms(timings["causal"])
        out[pass_] = {"window": timing_dict(timings["window"]), "causal": timing_dict(timings["causal"]),
                      "ratio": None if window is None or causal is None else window / causal}
    return out


def _tables(result: dict) -> str:
    rows = []
    for pass_, row in result["rows"].items():
        ratio = row["ratio"]
        rows.append([pass_, format_ms(row["window"]["median_ms"]), format_ms(row["causal"]["median_ms"]),
                     "n/a" if ratio is None else f"{ratio:.3f}", result["verdicts"].get(pass_, "not judged")])
    head = (f"Sliding window (W = {WINDOW}, causal) vs the full causal rule, B = {B}, H = {H}, L = S = "
            f"{result['length']}, D = {D}, fp32, backend `{result['backend']}`; {result['machine_text']}\n\n")
    table = markdown_table(["pass", "window ms", "causal ms", "window / causal", f"goal ≤ {MAX_WINDOW_RATIO:g}"],
                           rows)
    note = result["grid_note"].strip().strip("()").capitalize()
    return head + table + (f"\n\n{note}." if note else "") + \
        f"\n\nMax abs difference to SDPA with the band as a mask (output and gradients): {result['check_diff']:.2e}."


def _summary(result: dict) -> tuple:
    rows = [[p, "n/a" if r["ratio"] is None else f"{r['ratio']:.3f}", result["verdicts"].get(p, "not judged")]
            for p, r in result["rows"].items()]
    table = markdown_table(["pass", "window / causal", f"goal ≤ {MAX_WINDOW_RATIO:g}"], rows)
    return table, (f"`ae.scaled_dot_product_attention(..., is_causal=True, window_size=({WINDOW}, 0))` / the same "
                   f"call without the window, B = {B}, H = {H}, L = S = {result['length']}, D = {D}, fp32, "
                   f"`{result['backend']}`, 2 threads: the kernels skip the key chunks outside the band.")


def _plot(result: dict, path) -> None:
    plot_pass_bars(result["rows"], ("window", "causal"), path, f"W = {WINDOW} window vs causal, L = {result['length']}")


def run(options: BenchOptions) -> int:
    length = QUICK_L if options.quick else FULL_L
    machine = machine_info()
    progress(f"{NAME} benchmark ({options.grid} grid): L = {length}, W = {WINDOW}, backend={options.backend}; "
             f"{machine_markdown(machine)}")
    warnings = []
    diff = check(options.backend)
    if not diff <= CHECK_ATOL:
        warnings.append(f"the window differs from SDPA with the band as a mask by {diff:.3g} (> {CHECK_ATOL:g})")
    rows = measure(length, options.backend, options.repeats)
    verdicts = {}
    if length == FULL_L:
        for pass_, row in rows.items():
            judged = confirm(row["ratio"], MAX_WINDOW_RATIO, False,
                             lambda pass_=pass_: measure(length, options.backend, options.repeats)[pass_]["ratio"],
                             f"window / causal ({pass_})", log=progress)
            verdicts[pass_] = judged["verdict"]
    result = {"length": length, "window": WINDOW, "backend": options.backend, "rows": rows, "verdicts": verdicts,
              "check_diff": diff, "machine": machine, "machine_text": machine_markdown(machine),
              "grid_note": grid_note(options.quick, f"L = {FULL_L}", None if options.quick else f"L = {FULL_L}"),
              "warnings": warnings}
    return publish_run(NAME, result, _tables, _summary, options, plot=_plot)
