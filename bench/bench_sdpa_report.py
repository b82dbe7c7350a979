"""The ``sdpa`` benchmark's report: Markdown tables, the goal text, the README summary and the figure of a
result (the measurements are :mod:`bench.bench_sdpa`, which writes its report with this module; the goals
and labels both read are :mod:`bench.bench_sdpa_goals`)."""

from __future__ import annotations

from bench import bench_sdpa_transformer as tr
from bench.bench_sdpa_goals import CAUSAL_GOAL_L, LABELS, MAX_CAUSAL_RATIO, MAX_SDPA_RATIO, ratio
from bench.harness.calls import PASSES
from bench.harness.goals import confirmed_text
from bench.harness.machine import timing_footer
from bench.harness.plot import Series, plot_time_and_memory
from bench.harness.report import format_ms, markdown_table
from bench.harness.timing import WARMUP_TEXT

GOAL_TEXT = {
    "causal_vs_sdpa": f"causal, ours / SDPA `is_causal=True` <= {MAX_SDPA_RATIO:g}",
    "causal_vs_noncausal": f"ours causal / ours non-causal <= {MAX_CAUSAL_RATIO:g} at L = S = {CAUSAL_GOAL_L:,}",
    "mask_vs_sdpa": f"padding-plus-causal bool mask, ours / SDPA with the same mask <= {MAX_SDPA_RATIO:g}",
}


def _x(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}x"


def _ms(row: dict, impl: str) -> str | None:
    t = row["impls"].get(impl)
    return None if t is None else format_ms(t["median_ms"])


def _verdict(row: dict, goal: str) -> str:
    judged = row.get("judged", {}).get(goal)
    if judged is None:
        return "—"
    again = judged["values"][1] if judged["remeasured"] else None
    return judged["verdict"] + (f" (re-measured {again:.2f}x)" if again is not None else "")


def causal_table(rows: list[dict]) -> str:
    body = [[f"{r['L']:,}", r["pass"], _ms(r, "ours_causal"), _ms(r, "sdpa_causal"),
             _x(ratio(r, "ours_causal", "sdpa_causal")), _verdict(r, "causal_vs_sdpa"), _ms(r, "ours_full"),
             _x(ratio(r, "ours_causal", "ours_full")), _verdict(r, "causal_vs_noncausal"),
             _ms(r, "sdpa_full") or "—", _x(ratio(r, "sdpa_causal", "sdpa_full")) or "—"]
            for r in rows if r["section"] == "causal"]
    return markdown_table(
        ["L = S", "pass", "ours causal ms", "SDPA causal ms", "ours / SDPA", f"<= {MAX_SDPA_RATIO:g}",
         "ours non-causal ms", "ours causal / non-causal", f"<= {MAX_CAUSAL_RATIO:g} (at {CAUSAL_GOAL_L:,})",
         "SDPA non-causal ms", "SDPA causal / non-causal"], body, align="llrrrlrrlrr")


def mask_table(rows: list[dict]) -> str:
    body = [[f"{r['L']:,}", r["pass"], _ms(r, "ours_mask"), _ms(r, "sdpa_mask"),
             _x(ratio(r, "ours_mask", "sdpa_mask")), _verdict(r, "mask_vs_sdpa"), _ms(r, "ours_causal_kpm"),
             _x(ratio(r, "ours_causal_kpm", "sdpa_mask"))]
            for r in rows if r["section"] == "mask"]
    return markdown_table(["L = S", "pass", "ours mask ms", "SDPA mask ms", "ours / SDPA", f"<= {MAX_SDPA_RATIO:g}",
                           "ours is_causal + key_padding_mask ms", "that / SDPA mask"], body, align="llrrrlrr")


def goal_lines(result: dict) -> list[str]:
    """One line per goal: its verdict over its rows, with the re-measured values."""
    lines = []
    for goal, g in result["goals"].items():
        again = [f"L={r['L']:,} {r['pass']} " + confirmed_text(r["judged"][goal], lambda v: f"{v:.2f}x")
                 for r in result["rows"] if goal in r.get("judged", {}) and r["judged"][goal]["remeasured"]]
        counted = f"met in {g['rows_met']} of {g['rows']} rows, " if g["rows"] else ""
        lines.append(f"- Goal{g['grid_note']}: {GOAL_TEXT[goal]}: {counted}**{g['verdict']}**."
                     + (f" Re-measured before judging: {'; '.join(again)}." if again else ""))
    return lines


def _timing_text(cfg: dict) -> str:
    return (f"Median of at least {cfg['repeats']} samples, spread over at least {cfg['min_timed_s']:g} s per row, after "
            f"{WARMUP_TEXT}, "
            f"the implementations' samples interleaved; from L = {cfg['large_L']:,} on, {cfg['large_repeats']} "
            "samples without a warm-up round (calls of tens of seconds). **fwd+bwd**: forward, then "
            "`torch.autograd.grad(out, (q, k, v), grad_out)`.")


def tables(result: dict) -> str:
    """The full Markdown block (stdout and ``sdpa.md``)."""
    cfg, kernels = result["config"], result["sdpa_kernels"]
    return "\n".join([
        f"`ae.scaled_dot_product_attention(..., backend=\"{cfg['backend']}\")` (ours) vs "
        f"`torch.nn.functional.scaled_dot_product_attention` (SDPA; kernel here: {kernels['causal']} causal, "
        f"{kernels['mask']} with the mask), B={cfg['B']}, H={cfg['H']}, D={cfg['D']}, fp32, CPU, L = S. "
        + _timing_text(cfg) + " A ratio below 1 = ours faster.",
        "",
        "**Causal self-attention** (`is_causal=True`; non-causal for the causal saving; SDPA non-causal for scale, "
        f"up to L = {cfg['sdpa_noncausal_max_L']:,}):",
        "",
        causal_table(result["rows"]),
        "",
        f"**Padding-plus-causal bool mask** `[B, 1, L, S]` (True = take part), given as `attn_mask` to both: causal, "
        f"and batch entry b pads its last round({cfg['pad_fraction']:g}·S·(b+1)/B) keys (the last entry "
        f"{cfg['pad_fraction']:.0%}). Ours also with the same pairs as `is_causal=True` + `key_padding_mask` "
        "(no goal):",
        "",
        mask_table(result["rows"]),
        "",
        *goal_lines(result),
        "",
        "**Transformer training step** (before and after `ae.nn.swap_attention`):",
        "",
        tr.table(result["transformer"]),
        "",
        "Checked before timing against SDPA on [2, 2, 96, 64] (outputs and q, k, v gradients), max abs difference: "
        + ", ".join(f"{case} {d:.2g}" for case, d in result["check_max_abs_diff"].items()) + ".",
        "",
        *timing_footer(result["machine"]),
    ])


def summary(result: dict) -> tuple[str, str]:
    """The README's short table (ratios per L) and its paragraph."""
    cfg = result["config"]
    by = {(r["section"], r["L"], r["pass"]): r for r in result["rows"]}
    lengths = sorted({r["L"] for r in result["rows"]})

    def cell(section, length, pass_, a, b):
        row = by.get((section, length, pass_))
        return "—" if row is None else _x(ratio(row, a, b))

    body = [[f"{n:,}", *(cell("causal", n, p, "ours_causal", "sdpa_causal") for p in PASSES),
             *(cell("causal", n, p, "ours_causal", "ours_full") for p in PASSES),
             *(cell("mask", n, p, "ours_mask", "sdpa_mask") for p in PASSES)] for n in lengths]
    table = markdown_table(["L = S", "causal ours / SDPA fwd", "fwd+bwd", "ours causal / non-causal fwd", "fwd+bwd",
                            "mask ours / SDPA fwd", "fwd+bwd"], body)
    goals = " ".join(f"{GOAL_TEXT[g][0].upper()}{GOAL_TEXT[g][1:]}{v['grid_note']}: **{v['verdict']}**."
                     for g, v in result["goals"].items())
    return (table, f"`ae.scaled_dot_product_attention` ({cfg['backend']}) vs SDPA, B={cfg['B']}, H={cfg['H']}, "
                   f"D={cfg['D']}, fp32, {result['machine']['torch_threads']} threads, time ratios (below 1 = ours "
                   f"faster). {goals} {tr.summary_sentence(result['transformer'])}")


def plot(result: dict, path) -> None:
    """Time vs L, fwd (left) and fwd+bwd (right): ours and SDPA, causal, non-causal and masked."""
    styles = {"ours_causal": ("-", "o", "C0"), "ours_full": ("--", "o", "C0"), "sdpa_causal": ("-", "s", "k"),
              "sdpa_full": ("--", "s", "k"), "ours_mask": (":", "^", "C2"), "sdpa_mask": (":", "v", "C3")}

    def series(pass_):
        out = []
        for impl, (ls, marker, color) in styles.items():
            pts = [(r["L"], r["impls"][impl]["median_ms"]) for r in result["rows"]
                   if r["pass"] == pass_ and impl in r["impls"]]
            if pts:
                xs, ys = zip(*pts)
                out.append(Series(LABELS[impl], xs, ys, ls, marker, color))
        return out

    cfg = result["config"]
    plot_time_and_memory(series("fwd"), series("fwd+bwd"), path, xlabel="L = S",
                         title=f"scaled_dot_product_attention, B={cfg['B']} H={cfg['H']} D={cfg['D']} fp32, "
                               f"{result['machine']['torch_threads']} threads",
                         time_label="time (ms, median)", memory_label="time (ms, median)", titles=("fwd", "fwd+bwd"))
