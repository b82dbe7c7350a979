"""``python -m bench run te_attention``: the fused translation-equivariant attention against the unfused formula.

``ae.te_attention`` (C++ kernels: the MLP ρ per tile of (query, key) pairs, an online softmax per head, the MLP
recomputed in the backward) against the same maths in plain PyTorch (``attn_ext.ops.te_attention.naive.dense``, the
``[B, M, N, hidden]`` hidden layer of a PyTorch TE-TNP), B = 8, H = 4, M = N, D = Dv = 16, dx = 2, hidden = 64,
ReLU, fp32, forward and forward+backward (gradients of all nine tensors), timed in this process with the repeats
interleaved.

FLOPs are counted per (query, key) pair, multiply-adds as two: forward ``2·H·D`` (scores) ``+ 2·hidden·(H + dx)
+ 2·hidden·H`` (ρ) ``+ 2·H·Dv`` (values); the backward recomputes the forward's scores and ρ and adds ``4·H·Dv``
(dP, dV), ``4·hidden·H + 4·hidden·(H + dx)`` (ρ's pull-back: weight gradients and input gradients) and ``4·H·D``
(dQ, dK). ρ is about 85 % of them. The achieved rate is set against this machine's fp32 matmul rate, measured in
the same process (``torch.mm`` of 2048² fp32 matrices).

Goal (issue 45, full grid, M = N = 1024): fused / unfused ≤ :data:`MAX_RATIO`, forward and forward+backward. The
quick grid (``make bench``) runs M = N = 512 and judges the same ratio there. Before timing, the fused op's output
and gradients are checked against the dense formula in fp64. Writes ``te_attention.{md,json,png}``.
"""

from __future__ import annotations

import time

import torch

import attn_ext as ae
from attn_ext.ops.te_attention import naive
from bench.harness import BenchOptions
from bench.harness.calls import PASSES
from bench.harness.goals import confirm, grid_note
from bench.harness.machine import machine_info, machine_markdown
from bench.harness.plot import plot_pass_bars
from bench.harness.report import format_ms, markdown_table, progress, publish_run, timing_dict
from bench.harness.timing import median_ms, time_interleaved

NAME = "te_attention"
B, H, D, DX, HIDDEN = 8, 4, 16, 2, 64
FULL_L, QUICK_L = 1024, 512
#: Goal: fused time / unfused time, forward and forward+backward.
MAX_RATIO = 0.5
#: Max abs difference to the dense formula in fp64 (output and gradients) before the report warns.
CHECK_ATOL = 1e-9


def flops(length: int, pass_: str) -> float:
    """The FLOPs of one call at M = N = ``length`` (module docstring)."""
    forward = 2 * H * D + 2 * HIDDEN * (H + DX) + 2 * HIDDEN * H + 2 * H * D
    backward = forward + 4 * H * D + 4 * HIDDEN * H + 4 * HIDDEN * (H + DX) + 4 * H * D
    return float(B * length * length * (forward if pass_ == "fwd" else forward + backward))


def make_inputs(length: int, dtype=torch.float32, seed: int = 0, batch: int = B) -> list:
    g = torch.Generator().manual_seed(seed)
    shapes = ((batch, H, length, D), (batch, H, length, D), (batch, H, length, D), (batch, length, DX),
              (batch, length, DX), (HIDDEN, H + DX), (HIDDEN,), (H, HIDDEN), (H,))
    scales = (1.0, 1.0, 1.0, 1.0, 1.0, (H + DX) ** -0.5, 0.5, HIDDEN ** -0.5, 0.5)
    return [torch.randn(s, generator=g, dtype=dtype) * c for s, c in zip(shapes, scales)]


def check(backend: str) -> float:
    """Max abs difference of the fused op's output and nine gradients to the dense formula, fp64."""
    inputs = [t.requires_grad_() for t in make_inputs(77, torch.float64, seed=3, batch=2)]
    ours = ae.te_attention(*inputs, backend=backend)
    theirs, _ = naive.dense(*inputs)
    g = torch.randn(ours.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    diffs = [(ours - theirs).abs().max()]
    diffs += [(a - b).abs().max() for a, b in zip(torch.autograd.grad(ours, inputs, g),
                                                  torch.autograd.grad(theirs, inputs, g))]
    return float(max(diffs))


def matmul_rate() -> float:
    """This machine's fp32 matmul rate in GFLOP/s (torch.mm, 2048², best of three after a warm-up)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(3))
    return 2 * 2048 ** 3 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _call(fn, pass_: str, inputs: list):
    if pass_ == "fwd":
        return lambda: fn(*inputs)
    leaves = [t.detach().requires_grad_() for t in inputs]
    grad_out = torch.randn(B, H, inputs[0].shape[2], D, generator=torch.Generator().manual_seed(1))
    return lambda: torch.autograd.grad(fn(*leaves), leaves, grad_out)


def measure(length: int, backend: str, repeats: int) -> dict:
    """``{pass: {"fused": timing, "unfused": timing, "ratio", "gflops"}}`` at M = N = ``length``."""
    inputs = make_inputs(length)
    fns = {"fused": lambda *t: ae.te_attention(*t, backend=backend), "unfused": lambda *t: naive.dense(*t)[0]}
    out = {}
    for pass_ in PASSES:
        progress(f"  M = N = {length}, {pass_} ...")
        with torch.set_grad_enabled(pass_ != "fwd"):
            timings = time_interleaved({name: _call(fn, pass_, inputs) for name, fn in fns.items()},
                                       repeats=repeats, warmup=1)
        fused, unfused = median_ms(timings["fused"]), median_ms(timings["unfused"])
        out[pass_] = {"fused": timing_dict(timings["fused"]), "unfused": timing_dict(timings["unfused"]),
                      "ratio": None if fused is None or unfused is None else fused / unfused,
                      "gflops": None if fused is None else flops(length, pass_) / (fused * 1e-3) / 1e9}
    return out


def _tables(result: dict) -> str:
    rows = []
    for pass_, row in result["rows"].items():
        ratio, rate = row["ratio"], row["gflops"]
        rows.append([pass_, format_ms(row["fused"]["median_ms"]), format_ms(row["unfused"]["median_ms"]),
                     "n/a" if ratio is None else f"{ratio:.3f}",
                     "n/a" if rate is None else f"{rate:.1f} ({100 * rate / result['matmul_gflops']:.0f} %)",
                     result["verdicts"].get(pass_, "not judged")])
    head = (f"`ae.te_attention` (fused, backend `{result['backend']}`) vs the unfused formula in PyTorch, B = {B}, "
            f"H = {H}, M = N = {result['length']}, D = Dv = {D}, dx = {DX}, hidden = {HIDDEN}, ReLU, fp32; "
            f"{result['machine_text']}\n\n")
    table = markdown_table(["pass", "fused ms", "unfused ms", "fused / unfused", "fused GFLOP/s (of matmul)",
                            f"goal ≤ {MAX_RATIO:g}"], rows)
    note = result["grid_note"].strip().strip("()")
    note = note[:1].upper() + note[1:]
    return (head + table + (f"\n\n{note}." if note else "") +
            f"\n\nThis machine's fp32 matmul rate (torch.mm, 2048², same process): {result['matmul_gflops']:.1f} "
            f"GFLOP/s. FLOPs per (query, key) pair: {flops(1, 'fwd') / B:.0f} forward, "
            f"{flops(1, 'fwd+bwd') / B:.0f} forward+backward (the MLP ρ about 85 %; module docstring of "
            f"bench/bench_te_attention.py).\n\nMax abs difference to the dense formula in fp64 (output and the nine "
            f"gradients): {result['check_diff']:.2e}.")


def _summary(result: dict) -> tuple:
    rows = [[p, "n/a" if r["ratio"] is None else f"{r['ratio']:.3f}",
             "n/a" if r["gflops"] is None else f"{r['gflops']:.1f}", result["verdicts"].get(p, "not judged")]
            for p, r in result["rows"].items()]
    table = markdown_table(["pass", "fused / unfused", "fused GFLOP/s", f"goal ≤ {MAX_RATIO:g}"], rows)
    return table, (f"`ae.te_attention` / the same maths in plain PyTorch, B = {B}, H = {H}, M = N = "
                   f"{result['length']}, D = {D}, dx = {DX}, hidden = {HIDDEN}, fp32, `{result['backend']}`, 2 "
                   f"threads; matmul rate here {result['matmul_gflops']:.0f} GFLOP/s.")


def _plot(result: dict, path) -> None:
    plot_pass_bars(result["rows"], ("fused", "unfused"), path, f"TE attention, M = N = {result['length']}")


def run(options: BenchOptions) -> int:
    length = QUICK_L if options.quick else FULL_L
    backend = options.backend
    machine = machine_info()
    progress(f"{NAME} benchmark ({options.grid} grid): M = N = {length}, backend={backend}; "
             f"{machine_markdown(machine)}")
    warnings = []
    diff = check(backend)
    if not diff <= CHECK_ATOL:
        warnings.append(f"the fused op differs from the dense formula by {diff:.3g} (> {CHECK_ATOL:g}) in fp64")
    rate = matmul_rate()
    rows = measure(length, backend, options.repeats)
    verdicts = {}
    for pass_, row in rows.items():
        judged = confirm(row["ratio"], MAX_RATIO, False,
                         lambda pass_=pass_: measure(length, backend, options.repeats)[pass_]["ratio"],
                         f"fused / unfused ({pass_})", log=progress)
        verdicts[pass_] = judged["verdict"]
    result = {"length": length, "backend": backend, "rows": rows, "verdicts": verdicts, "check_diff": diff,
              "matmul_gflops": rate, "machine": machine, "machine_text": machine_markdown(machine),
              "grid_note": grid_note(options.quick, f"M = N = {FULL_L}", f"M = N = {QUICK_L}" if options.quick
                                     else f"M = N = {FULL_L}"),
              "warnings": warnings}
    return publish_run(NAME, result, _tables, _summary, options, plot=_plot)
