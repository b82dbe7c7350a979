"""``python -m bench run sdpa_bias``: a learned additive bias (``attn_mask`` that requires grad) on the CPU.

A training step's forward and backward of ``ae.scaled_dot_product_attention(q, k, v, attn_mask=bias)`` with a bias
``[H, L, S]`` shared by the batch (a relative-position or pair bias) that requires grad, against PyTorch's SDPA
math path on the same call (``sdpa_kernel(SDPBackend.MATH)``, what PyTorch runs for a mask that needs a gradient),
B = 4, H = 8, D = 64, fp32, L = S, timed in this process with the samples interleaved; the gradients of q, k, v and
the bias are checked against SDPA's first. Peak extra memory of one step in a fresh process each
(``bench.harness.memory``): ours forms no ``[B, H, L, S]`` buffer (the chunked backward sums each key chunk's score
gradient into the bias's shape; its partial dQ sums cover one key/value head's query rows per thread, threads·L·D
numbers), SDPA's math path several.

Goals (issue 44, full grid, L = 2048): time ours / SDPA math ≤ :data:`MAX_TIME_RATIO`; ours' peak beyond its
outputs and gradients (out, dq, dk, dv, dbias) below one ``[B, H, L, S]`` fp32 tensor. The quick grid (``make
bench``) runs L = 1024 and reports without judging. Writes ``sdpa_bias.{md,json,png}``.
"""

from __future__ import annotations

import torch

import attn_ext as ae
from bench.harness import BenchOptions
from bench.harness import goals
from bench.harness.goals import confirm, grid_note
from bench.harness.machine import machine_info, machine_markdown
from bench.harness.memory import measure_peak_extra
from bench.harness.report import format_ms, markdown_table, progress, publish_run, timing_dict
from bench.harness.timing import median_ms, time_interleaved

NAME = "sdpa_bias"
B, H, D = 4, 8, 64
FULL_L, QUICK_L = 2048, 1024
#: Goal: ours / SDPA math, forward+backward, at FULL_L.
MAX_TIME_RATIO = 1.0
#: Max abs difference of the four gradients to SDPA's (fp32, order-1 values) before the report warns.
CHECK_ATOL = 1e-3


def problem(length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, length, D, generator=gen) for _ in range(3))
    bias = torch.randn(H, length, length, generator=gen)
    grad = torch.randn(B, H, length, D, generator=gen)
    return q, k, v, bias, grad


def step(impl: str, q, k, v, bias, grad):
    """One forward+backward with every input a leaf that requires grad: the four gradients."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v, bias)]
    if impl == "ours":
        out = ae.scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3])
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            out = torch.nn.functional.scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3])
    return torch.autograd.grad(out, leaves, grad)


def memory_probe(impl: str, length: int):
    """For ``bench.harness.memory``: the step to measure, its inputs built."""
    torch.set_num_threads(2)
    inputs = problem(length)
    return lambda: step(impl, *inputs)


def check(length: int = 256) -> float:
    inputs = problem(length, seed=3)
    return float(max((a - b).abs().max() for a, b in zip(step("ours", *inputs), step("sdpa_math", *inputs))))


def measure(length: int, repeats: int) -> dict:
    inputs = problem(length)
    progress(f"  L = {length}, forward+backward ...")
    timings = time_interleaved({impl: (lambda impl=impl: step(impl, *inputs)) for impl in ("ours", "sdpa_math")},
                               repeats=repeats, warmup=1)
    ours, theirs = median_ms(timings["ours"]), median_ms(timings["sdpa_math"])
    return {"ours": timing_dict(timings["ours"]), "sdpa_math": timing_dict(timings["sdpa_math"]),
            "ratio": None if ours is None or theirs is None else ours / theirs}


def memory(length: int) -> dict:
    """Peak extra MB of one step for each, and ours beyond its outputs and gradients."""
    out = {}
    for impl in ("ours", "sdpa_math"):
        progress(f"  peak memory of {impl} (a fresh process) ...")
        peak = measure_peak_extra("bench.bench_sdpa_bias:memory_probe", {"impl": impl, "length": length})
        out[impl] = {"mb": peak.mb, "method": peak.method, "note": peak.note}
    elements = B * H * length * D  # out, dq, dk, dv: one [B, H, L, D] each
    out["outputs_mb"] = (4 * elements + H * length * length) * 4 / 1e6  # ... and dbias [H, L, S]
    out["full_scores_mb"] = B * H * length * length * 4 / 1e6
    ours = out["ours"]["mb"]
    out["ours_beyond_mb"] = None if ours is None else ours - out["outputs_mb"]
    return out


def _tables(result: dict) -> str:
    row, mem = result["timing"], result["memory"]
    head = (f"A learned bias `[H, L, S]` (requires grad) shared by the batch, forward+backward, B = {B}, H = {H}, "
            f"L = S = {result['length']}, D = {D}, fp32: `ae.scaled_dot_product_attention` (cpp) vs PyTorch's SDPA "
            f"math path; {result['machine_text']}\n\n")
    ratio = row["ratio"]
    timing = markdown_table(["ours ms", "SDPA math ms", "ours / SDPA", f"goal ≤ {MAX_TIME_RATIO:g}"],
                            [[format_ms(row["ours"]["median_ms"]), format_ms(row["sdpa_math"]["median_ms"]),
                              "n/a" if ratio is None else f"{ratio:.3f}", result["verdicts"].get("time", "not judged")]])

    def mb(x):
        return "n/a" if x is None else f"{x:.0f}"

    memory_table = markdown_table(
        ["", "peak extra MB", "method"],
        [["ours", mb(mem["ours"]["mb"]), mem["ours"]["method"]],
         ["SDPA math", mb(mem["sdpa_math"]["mb"]), mem["sdpa_math"]["method"]],
         ["outputs and gradients (out, dq, dk, dv, dbias)", mb(mem["outputs_mb"]), "sizes"],
         ["ours beyond them", mb(mem["ours_beyond_mb"]), result["verdicts"].get("memory", "not judged")],
         [f"one [B, H, L, S] fp32 tensor", mb(mem["full_scores_mb"]), "the bound"]])
    note = result["grid_note"].strip().strip("()").capitalize()
    return (head + timing + "\n\n" + memory_table + (f"\n\n{note}." if note else "")
            + f"\n\nMax abs difference of the four gradients to SDPA's (L = 256): {result['check_diff']:.2e}.")


def _summary(result: dict) -> tuple:
    row, mem = result["timing"], result["memory"]
    ratio = row["ratio"]
    beyond = mem["ours_beyond_mb"]
    table = markdown_table(["ours / SDPA math (time)", "ours beyond outputs+grads, MB", "SDPA math peak MB"],
                           [["n/a" if ratio is None else f"{ratio:.3f} ({result['verdicts'].get('time', 'not judged')})",
                             "n/a" if beyond is None else f"{beyond:.0f} ({result['verdicts'].get('memory', 'not judged')})",
                             "n/a" if mem["sdpa_math"]["mb"] is None else f"{mem['sdpa_math']['mb']:.0f}"]])
    return table, (f"A learned bias `[H, L, S]` that requires grad, forward+backward, B = {B}, H = {H}, L = S = "
                   f"{result['length']}, D = {D}, fp32, 2 threads: the chunked backward sums each key chunk's score "
                   "gradient into the bias's shape, so no [B, H, L, S] buffer exists.")


def _plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    row, mem = result["timing"], result["memory"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(7, 3.2))
    names = ["ours", "SDPA math"]
    a.bar(names, [row["ours"]["median_ms"] or 0, row["sdpa_math"]["median_ms"] or 0])
    a.set_ylabel("ms (median), fwd+bwd")
    b.bar(names, [mem["ours"]["mb"] or 0, mem["sdpa_math"]["mb"] or 0])
    b.axhline(mem["outputs_mb"], color="grey", linestyle="--", label="outputs + gradients")
    b.set_ylabel("peak extra MB")
    b.legend(fontsize=7)
    fig.suptitle(f"learned bias [H, L, S], L = {result['length']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(options: BenchOptions) -> int:
    length = QUICK_L if options.quick else FULL_L
    machine = machine_info()
    progress(f"{NAME} benchmark ({options.grid} grid): L = {length}; {machine_markdown(machine)}")
    warnings = []
    diff = check()
    if not diff <= CHECK_ATOL:
        warnings.append(f"the gradients differ from SDPA's by {diff:.3g} (> {CHECK_ATOL:g})")
    timing = measure(length, options.repeats)
    mem = memory(length)
    verdicts = {}
    if length == FULL_L:
        verdicts["time"] = confirm(timing["ratio"], MAX_TIME_RATIO, False,
                                   lambda: measure(length, options.repeats)["ratio"], "ours / SDPA math",
                                   log=progress)["verdict"]
        beyond = mem["ours_beyond_mb"]
        verdicts["memory"] = ("not measured" if beyond is None else
                              goals.verdict(beyond < mem["full_scores_mb"]))
    result = {"length": length, "timing": timing, "memory": mem, "verdicts": verdicts, "check_diff": diff,
              "machine": machine, "machine_text": machine_markdown(machine),
              "grid_note": grid_note(options.quick, f"L = {FULL_L}", None if options.quick else f"L = {FULL_L}"),
              "warnings": warnings}
    return publish_run(NAME, result, _tables, _summary, options, plot=_plot)
