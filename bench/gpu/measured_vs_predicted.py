"""A GPU run's measured rows beside the committed predictions, as the Markdown of bench/results/gpu.md's
"measured beside predicted" section:

    python -m bench.gpu.measured_vs_predicted BENCH_JSON [BENCH_JSON ...] [--out FILE]

Each BENCH_JSON is a ``bench.json`` written by ``python -m bench.gpu.bench_cuda``; give several runs in the
order they ran. A time measured in several runs is shown from the last of them; the "runs" column says which
runs measured it and gives the others' times where they differ from it by more than :data:`RUNS_AGREE`.
How rows find their predictions is :mod:`bench.gpu.measured_rows`' docstring.

Per section (attention first): one line per measured case and implementation (predicted ms, measured ms,
measured / predicted, measured TFLOP/s where the work is a flop count, and a mark on times more than
:data:`bench.gpu.measured_rows.MARK_FACTOR` x from their prediction, either way), then how many rows no run
measured and why. Then, for attention, ours over SDPA's flash kernel per case; last, the times furthest from
their predictions.
"""
from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from pathlib import Path

from bench.gpu import predicted
from bench.gpu.attention_impls import REFERENCE
from bench.gpu.measured_rows import (MARK_FACTOR, Line, Run, compare, not_measured, predictions, read_run,
                                     unmeasured_predictions)
from bench.harness.report import markdown_table

#: Two runs' times of one row within this fraction of the shown one count as agreeing.
RUNS_AGREE = 0.10
#: bench.json's sections in the order they run, with their titles.
TITLES = {"attention": "Attention", "states": "Attention states", "tree": "Tree cross attention",
          "other": "Intention and Cholesky"}
#: Our backends in the pivot's columns, Triton first (the one meant to be fast).
PIVOT_IMPLS = ("triton", "cuda")
#: Lines in the closing list of the times furthest from their predictions.
FURTHEST = 10


def fmt_ms(ms: float | None) -> str | None:
    return None if ms is None else f"{ms:,.0f}" if ms >= 1000 else f"{ms:.3g}"


def mark(line: Line) -> str:
    """The mark of a time more than MARK_FACTOR x from its prediction: slower or faster than predicted."""
    return "" if not line.marked else "**slower**" if line.ratio > 1 else "**faster**"


def runs_cell(line: Line) -> str:
    """The run shown, then the other runs that measured the row: "also 1" where they agree within
    :data:`RUNS_AGREE`, their time and how far it is where they do not."""
    agree = [str(i) for i, ms in line.others if abs(ms / line.measurement.ms - 1) <= RUNS_AGREE]
    differ = [f"{i}: {fmt_ms(ms)} ms, {100 * (ms / line.measurement.ms - 1):+.0f} %" for i, ms in line.others
              if abs(ms / line.measurement.ms - 1) > RUNS_AGREE]
    extra = ([f"also {', '.join(agree)}"] if agree else []) + differ
    return f"{line.run}" + (f" ({'; '.join(extra)})" if extra else "")


def run_legend(runs: list[Run]) -> list[str]:
    lines = []
    for i, run in enumerate(runs, 1):
        machine = run.header.split(". Times are")[0].removeprefix("GPU benchmarks on ").strip() or "no header"
        ceilings = run.ceilings
        measured = (f"; ceilings measured: bf16 products {ceilings['matmul_bf16_tflops']:.0f} TFLOP/s, copy "
                    f"{ceilings['copy_tbps']:.2f} TB/s (the model assumes {predicted.MATMUL_TFLOPS:g} and "
                    f"{predicted.COPY_TBPS:g})") if {"matmul_bf16_tflops", "copy_tbps"} <= set(ceilings) else ""
        lines.append(f"- run {i}: `{run.path}`: {machine}{measured}.")
    return lines


def section_table(lines: list[Line], section: str, several_runs: bool) -> str:
    named = section != "attention"  # other sections' predictions have their own names, shown beside ours
    header = ["case", "implementation", *(["predicted as"] if named else []), "predicted ms", "measured ms",
              "measured / predicted", "TFLOP/s measured", *(["runs"] if several_runs else []),
              f"> {MARK_FACTOR:g}x off"]
    body = []
    for ln in lines:
        m, p = ln.measurement, ln.prediction
        body.append([m.case, m.impl, *([p.implementation if p else "no prediction"] if named else []),
                     fmt_ms(p.predicted_ms) if p else "no prediction", fmt_ms(m.ms),
                     f"{ln.ratio:.2f}" if p else "", f"{ln.tflops:.0f}" if ln.tflops else "",
                     *([runs_cell(ln)] if several_runs else []), mark(ln)])
    align = "ll" + ("l" if named else "") + "rrrr" + ("l" if several_runs else "") + "l"
    return markdown_table(header, body, align=align)


def not_measured_sentence(reasons: Counter, unpredicted_count: int, unmeasured_count: int) -> str:
    parts = [f"Not measured in any run: {sum(reasons.values())} rows"
             + (" (" + "; ".join(f"{why}: {n}" for why, n in reasons.most_common()) + ")" if reasons else "") + "."]
    if unpredicted_count:
        parts.append(f"Measured without a prediction: {unpredicted_count}.")
    parts.append(f"Predictions no measured time was set against: {unmeasured_count}.")
    return " ".join(parts)


def pivot(runs: list[Run]) -> str:
    """Per attention case, flash's time over ours (our TFLOP/s over flash's), each pair from the last run
    that measured both; the predicted ratio in brackets."""
    per_run = [{(m.case, m.impl): m for m in run.measured if m.section == "attention"} for run in runs]
    cases = list(dict.fromkeys(case for found in per_run for case, _ in found))
    table = predictions()
    body = []
    for case in cases:
        flash = next((found[(case, REFERENCE)] for found in reversed(per_run) if (case, REFERENCE) in found), None)
        cells = []
        for impl in PIVOT_IMPLS:
            pair = next(((found[(case, REFERENCE)], found[(case, impl)]) for found in reversed(per_run)
                         if (case, REFERENCE) in found and (case, impl) in found), None)
            want = table.get((case, REFERENCE)), table.get((case, impl))
            expected = f" ({want[0].predicted_ms / want[1].predicted_ms:.2f})" if all(want) else ""
            cells.append(f"{pair[0].ms / pair[1].ms:.2f}{expected}" if pair else "")
        body.append([case, fmt_ms(flash.ms) if flash else "", *cells])
    header = ["case", f"{REFERENCE} ms", *(f"{impl} / {REFERENCE}" for impl in PIVOT_IMPLS)]
    return markdown_table(header, body, align="lrrr")


def furthest(lines: list[Line], count: int = FURTHEST) -> str:
    """The ``count`` times furthest from their predictions (by the size of the log of their ratio)."""
    found = [ln for ln in lines if ln.prediction and ln.measurement.ms > 0]
    ranked = sorted(found, key=lambda ln: -abs(math.log(ln.ratio)))[:count]
    body = [[ln.measurement.section, ln.measurement.case, ln.measurement.impl, fmt_ms(ln.prediction.predicted_ms),
             fmt_ms(ln.measurement.ms), f"{ln.ratio:.2f}", mark(ln)] for ln in ranked]
    return markdown_table(["section", "case", "implementation", "predicted ms", "measured ms", "measured / predicted",
                           f"> {MARK_FACTOR:g}x off"], body, align="lllrrrl")


def markdown(runs: list[Run]) -> str:
    lines = compare(runs)
    reasons, unused = not_measured(runs), unmeasured_predictions(lines)
    marked = sum(ln.marked for ln in lines)
    out = ["### Measured beside predicted", "",
           f"Written by `python -m bench.gpu.measured_vs_predicted` from {len(runs)} run(s) of "
           "`python -m bench.gpu.bench_cuda`; the predictions are [gpu_predicted.md](gpu_predicted.md), committed "
           "before any window measured these rows. Measured / predicted above 1: slower than predicted. "
           f"{marked} of {len(lines)} measured times are more than {MARK_FACTOR:g}x from their prediction "
           "(marked)." + (" A time measured in several runs is the last run's; the runs column names the others "
                          f"(their time where it differs by more than {100 * RUNS_AGREE:g} %)."
                          if len(runs) > 1 else ""),
           "", *run_legend(runs)]
    for section, title in TITLES.items():
        mine = [ln for ln in lines if ln.measurement.section == section]
        out += ["", f"#### {title}", ""]
        if mine:
            out += [section_table(mine, section, len(runs) > 1), ""]
        out.append(not_measured_sentence(reasons.get(section, Counter()),
                                         sum(ln.prediction is None for ln in mine), unused.get(section, 0)))
    out += ["", f"#### Attention: ours over {REFERENCE}, measured", "",
            f"{REFERENCE}'s time over ours (= our TFLOP/s over its; above 1: ours is faster), each pair from the "
            "last run that measured both; the prediction's ratio in brackets.", "", pivot(runs),
            "", f"#### The {FURTHEST} times furthest from their predictions", "", furthest(lines)]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench_json", nargs="+", type=Path, help="bench.json files, in the order the runs ran")
    parser.add_argument("--out", type=Path, help="also write the Markdown to this file")
    args = parser.parse_args(argv)
    text = markdown([read_run(path) for path in args.bench_json])
    if args.out:
        args.out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
