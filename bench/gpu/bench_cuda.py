"""The GPU benchmarks of attn_ext's ``cuda`` and ``triton`` backends: stage "bench" of ``make gpu-check``.

    python -m bench.gpu.bench_cuda [--out DIR] [--time-limit SECONDS] [--cases goals|bf16|all]
                                   [--sections attention states ...] [--order priority|sections] [--max-call-s S]

Sections (one module each; each checks a call's result before timing it and stops the benchmark with
:class:`bench.gpu.checks.WrongResult` if it is wrong):

- ``attention`` (:mod:`bench.gpu.attention`): attention fwd and fwd+bwd TFLOP/s, fp16/bf16, B=8, H=16,
  D in {64, 128}, M = N in {1k, 4k, 16k}, causal and not; ours (``ae.scaled_dot_product_attention``, cuda and
  triton) vs SDPA's flash, cuDNN and memory-efficient kernels and FlexAttention;
- ``states`` (:mod:`bench.gpu.states`): state update vs recomputation (the CPU benchmark's problem), merge;
- ``tree`` (:mod:`bench.gpu.tree`): tree cross attention vs full cross attention and SDPA;
- ``other_ops`` (:mod:`bench.gpu.other_ops`): Intention, σIntention vs SDPA; batched Cholesky vs torch;
- ``features`` (:mod:`bench.gpu.features`): a sliding window vs full causal, a packed (varlen) batch vs SDPA on
  the padded one, decoding over 1e6 keys vs SDPA, a learned bias with its gradient vs SDPA; each with its
  prediction.

The cases run in :mod:`bench.gpu.plan`'s order: attention's goal rows (bf16, D = 128, L = S in {4096, 16384})
first, then the rest of bf16, then fp16, then the other sections; ``--cases`` (default: the environment
variable ``GPU_BENCH_CASES``, else ``all``) keeps only the goal rows or only bf16 attention. A call slower
than ``--max-call-s`` is checked but not sampled, and one predicted slower (from its best rate earlier in
the run) is not made (:class:`bench.gpu.timing.Budget`); both rows say why under "Not measured".

The card's ceilings come first (:mod:`bench.gpu.ceilings`: bf16 matrix-product rate, copy bandwidth, in a
second), then the Triton kernels of the cases (each distinct set once, every kernel's configs shared out
among the workers) and FlexAttention of the first cases are compiled in parallel worker processes
(:mod:`bench.gpu.warm`, at most :data:`WARM_SHARE` of the time left); Triton's autotuning in the timing
process then only times the configs, two calls each for a slow one (:func:`bench.gpu.timing.quick_autotuning`).
Writes ``bench.md`` (the tables, in their reading order whatever the order of the run, rewritten after every
case, so a run stopped at its time limit still leaves what it measured) and ``bench.json`` (every row, with
the raw samples) to ``--out``; the tables also go to stdout, progress to stderr. Exit status 0; 1 when a
result was wrong or a call failed; 2 when there is no CUDA device or Triton would run in its interpreter.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from bench.gpu import ceilings, plan, warm
from bench.gpu.timing import AUTOTUNE_REP_MS, MAX_CALL_S, Budget, quick_autotuning
from bench.harness.report import progress

#: Seconds kept at the end of the time limit to write the files.
RESERVE_S = 10
#: Largest share of the time left after the ceilings that the warm-up may take: the timing process needs the rest
#: to reach the cases it warmed (see bench.gpu.warm).
WARM_SHARE = 0.35
#: Environment variable giving ``--cases`` its default (how bench/gpu/check.sh passes it through).
CASES_VARIABLE = "GPU_BENCH_CASES"
TITLES = {"attention": "Attention", "states": "Attention states", "tree": "Tree cross attention",
          "other_ops": "Intention and Cholesky", "features": "Windows, packed batches, decoding, a learned bias"}


def header(autotuning_problem: str | None) -> str:
    import triton  # Triton is optional: this module imports without it

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return (f"GPU benchmarks on **{torch.cuda.get_device_name()}** (compute capability {props.major}.{props.minor}, "
            f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB), torch {torch.__version__} "
            f"(CUDA {torch.version.cuda}), Triton {triton.__version__}, {datetime.date.today().isoformat()}. "
            "Times are medians of CUDA-event timings after warm-up; Triton's tiles were autotuned on first use ("
            + (f"one untimed call, then {AUTOTUNE_REP_MS} ms of timed calls, at least one, per tile configuration)."
               if autotuning_problem is None
               else f"Triton's default timing per configuration: {autotuning_problem})."))


def write(out: Path, parts: dict[str, str], rows: list[dict], meta: dict) -> None:
    """``bench.md`` (the sections' tables in :data:`plan.SECTIONS`'s order) and ``bench.json``."""
    out.mkdir(parents=True, exist_ok=True)
    tables = [f"## {TITLES[name]}\n\n{parts[name]}" for name in plan.SECTIONS if name in parts]
    text = "\n\n".join([f"# GPU benchmarks\n\n{meta['header']}"] + tables
                       + (["## Errors\n\n" + "\n".join(f"- {e}" for e in meta["errors"])] if meta["errors"] else []))
    (out / "bench.md").write_text(text + "\n")
    (out / "bench.json").write_text(json.dumps({**meta, "rows": rows}, indent=1, default=str))


def measure_all(cases: list[plan.Planned], budget: Budget, out: Path, meta: dict,
                keep_going: bool) -> tuple[list[dict], dict[str, str]]:
    """Measures ``cases`` in their order, rewriting the files after each; returns every row and each section's
    table. Stops at the first error (recorded in ``meta``) unless ``keep_going``; a case past the deadline
    costs nothing (each section's ``measure`` only writes its rows' notes then)."""
    rows: list[dict] = []
    parts: dict[str, str] = {}
    meta.setdefault("case_s", {})
    for p in cases:
        if meta["errors"] and not keep_going:
            break
        case_started = time.monotonic()
        try:
            rows += p.module.measure(p.case, budget, progress)
        except Exception as exc:  # noqa: BLE001 - recorded; the run stops there unless asked to go on
            meta["errors"].append(f"{p.section} {p.case.label}: {type(exc).__name__}: {exc}")
            progress(f"ERROR {meta['errors'][-1]}")
            traceback.print_exc()
        torch.cuda.empty_cache()
        # Seconds per case, with the Triton compiles and tuning in them: what tells whether the warm-up paid.
        meta["case_s"][p.id] = round(time.monotonic() - case_started, 1)
        progress(f"{p.section} {p.case.label}: {meta['case_s'][p.id]} s")
        parts[p.section] = p.module.markdown([r for r in rows if r["section"] == p.module.NAME])
        write(out, parts, rows, meta)
    return rows, parts


def run(out: Path, time_limit: float, cases: list[plan.Planned], jobs: int, keep_going: bool,
        max_call_s: float = MAX_CALL_S, scope: str = "all") -> int:
    started = time.monotonic()
    budget = Budget(deadline=started + time_limit - RESERVE_S, max_call_s=max_call_s)
    meta = {"header": header(quick_autotuning()), "errors": [], "warm_up": None,
            "cases": scope, "order": [p.id for p in cases], "max_call_s": max_call_s}
    meta["header"] += (f" Cases: {scope} ({len(cases)}), the goal rows first; calls over {max_call_s:g} s were "
                       "checked but not sampled (see each table's \"Not measured\").")
    try:
        meta["ceilings"] = ceilings.measure()
        meta["header"] += " " + ceilings.sentence(meta["ceilings"])
    except Exception as exc:  # noqa: BLE001 - not a wrong result: the benchmark runs on, the header says why
        meta["header"] += f" Ceilings not measured: {type(exc).__name__}: {exc}."
    progress(meta["header"])
    if jobs > 0 and cases:
        warm_s = WARM_SHARE * (budget.deadline - time.monotonic())
        meta["warm_up"] = warm.warm_in_parallel(cases, jobs, time_limit_s=warm_s)
        progress(meta["warm_up"])
    rows, parts = measure_all(cases, budget, out, meta, keep_going)
    meta["elapsed_s"] = round(time.monotonic() - started, 1)
    write(out, parts, rows, meta)
    print((out / "bench.md").read_text())
    if meta["errors"]:
        progress(f"{len(meta['errors'])} error(s); the first: {meta['errors'][0]}")
        return 1
    return 0


def parser() -> argparse.ArgumentParser:
    cases_default = os.environ.get(CASES_VARIABLE) or "all"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu"))
    parser.add_argument("--time-limit", type=float, default=600.0,
                        help="seconds for the whole benchmark; cases left when it is near are reported as not measured")
    parser.add_argument("--cases", choices=tuple(plan.SCOPES), default=cases_default,
                        help=f"goals: only attention's goal rows (bf16, D=128, L=S 4k and 16k); bf16: all bf16 "
                             f"attention; all: everything (default: ${CASES_VARIABLE}, else all)")
    parser.add_argument("--sections", nargs="+", choices=tuple(plan.SECTIONS), default=list(plan.SECTIONS))
    parser.add_argument("--order", choices=plan.ORDERS, default="priority",
                        help="priority: goal rows first, then bf16, fp16, the other sections; sections: each "
                             "section whole in the order of --sections")
    parser.add_argument("--max-call-s", type=float, default=MAX_CALL_S,
                        help="a call slower than this (seconds) is checked but not sampled, one predicted slower "
                             "is not made")
    parser.add_argument("--warm-jobs", type=int, default=min(16, os.cpu_count() or 1),
                        help="parallel processes compiling the Triton kernels and FlexAttention of the first cases "
                             "(0: none)")
    parser.add_argument("--keep-going", action="store_true", default=os.environ.get("GPU_CHECK_KEEP_GOING") == "1",
                        help="after a wrong result or a failed call, go on with the other cases")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.cases not in plan.SCOPES:  # argparse checks choices on the command line only, not on defaults
        print(f"{CASES_VARIABLE}={args.cases!r}: not one of {', '.join(plan.SCOPES)}", file=sys.stderr)
        return 2
    cases = plan.plan(args.sections, args.cases, args.order)
    if not cases:
        print(f"--cases {args.cases} keeps no case of the sections {' '.join(args.sections)}: nothing to measure",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("no CUDA device (torch.cuda.is_available() is False): this benchmark needs a GPU; nothing measured",
              file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1: the Triton rows would time the interpreter; run with TRITON_INTERPRET=0",
              file=sys.stderr)
        return 2
    return run(args.out, args.time_limit, cases, args.warm_jobs, args.keep_going, args.max_call_s, args.cases)


if __name__ == "__main__":
    sys.exit(main())
