"""The GPU benchmarks of attn_ext's ``cuda`` and ``triton`` backends: stage "bench" of ``make gpu-check``.

    python -m bench.gpu.bench_cuda [--out DIR] [--time-limit SECONDS] [--sections attention states ...]

Sections (one module each, run in this order; each checks a call's result before timing it and stops the
benchmark with :class:`bench.gpu.checks.WrongResult` if it is wrong):

- ``attention`` (:mod:`bench.gpu.attention`): attention fwd and fwd+bwd TFLOP/s, fp16/bf16, B=8, H=16,
  D in {64, 128}, M = N in {1k, 4k, 16k}, causal and not; ours (``ae.scaled_dot_product_attention``, cuda and
  triton) vs SDPA's flash, cuDNN and memory-efficient kernels and FlexAttention;
- ``states`` (:mod:`bench.gpu.states`): state update vs recomputation (the CPU benchmark's problem), merge;
- ``tree`` (:mod:`bench.gpu.tree`): tree cross attention vs full cross attention and SDPA;
- ``other_ops`` (:mod:`bench.gpu.other_ops`): Intention, σIntention vs SDPA; batched Cholesky vs torch.

The card's ceilings come first (:mod:`bench.gpu.ceilings`: bf16 matrix-product rate, copy bandwidth, in a
second), then the Triton kernels of every case are compiled in parallel worker processes (:mod:`bench.gpu.warm`).
Writes ``bench.md`` (the tables, rewritten after every case, so a run stopped at its time limit still
leaves what it measured) and ``bench.json`` (every row, with the raw samples) to ``--out``; the tables
also go to stdout, progress to stderr. Exit status 0; 1 when a result was wrong or a call failed; 2 when
there is no CUDA device or Triton would run in its interpreter.
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

from bench.gpu import ceilings, warm
from bench.gpu.timing import shorter_autotuning
from bench.harness.report import progress

#: Seconds kept at the end of the time limit to write the files.
RESERVE_S = 10


def header(autotuning_problem: str | None) -> str:
    import triton  # Triton is optional: this module imports without it

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return (f"GPU benchmarks on **{torch.cuda.get_device_name()}** (compute capability {props.major}.{props.minor}, "
            f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB), torch {torch.__version__} "
            f"(CUDA {torch.version.cuda}), Triton {triton.__version__}, {datetime.date.today().isoformat()}. "
            "Times are medians of CUDA-event timings after warm-up; Triton's tiles were autotuned on first use ("
            + ("5 ms + 20 ms per tile configuration)." if autotuning_problem is None
               else f"Triton's default timing per configuration: {autotuning_problem})."))


def write(out: Path, parts: dict[str, str], rows: list[dict], meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    text = "\n\n".join([f"# GPU benchmarks\n\n{meta['header']}"] + [f"## {name}\n\n{body}" for name, body in parts.items()]
                       + (["## Errors\n\n" + "\n".join(f"- {e}" for e in meta["errors"])] if meta["errors"] else []))
    (out / "bench.md").write_text(text + "\n")
    (out / "bench.json").write_text(json.dumps({**meta, "rows": rows}, indent=1, default=str))


def run(out: Path, time_limit: float, sections: list[str], jobs: int, keep_going: bool) -> int:
    started = time.monotonic()
    deadline = started + time_limit - RESERVE_S
    meta = {"header": header(shorter_autotuning()), "errors": [], "warm_up": None}
    try:
        meta["ceilings"] = ceilings.measure()
        meta["header"] += " " + ceilings.sentence(meta["ceilings"])
    except Exception as exc:  # noqa: BLE001 - not a wrong result: the benchmark runs on, the header says why
        meta["header"] += f" Ceilings not measured: {type(exc).__name__}: {exc}."
    progress(meta["header"])
    if jobs > 0:
        # Half the time at most: a warm-up that overran only leaves compiling to the timing process.
        meta["warm_up"] = warm.warm_in_parallel(sections, jobs, time_limit_s=0.5 * (deadline - time.monotonic()))
        progress(meta["warm_up"])
    rows: list[dict] = []
    parts: dict[str, str] = {}
    titles = {"attention": "Attention", "states": "Attention states", "tree": "Tree cross attention",
              "other_ops": "Intention and Cholesky"}
    for name in sections:
        module = warm.section(name)
        for case in module.cases():
            if meta["errors"] and not keep_going:
                break
            try:
                rows += module.measure(case, deadline, progress)
            except Exception as exc:  # noqa: BLE001 - recorded; the run stops there unless asked to go on
                meta["errors"].append(f"{name} {case.label}: {type(exc).__name__}: {exc}")
                progress(f"ERROR {meta['errors'][-1]}")
                traceback.print_exc()
            torch.cuda.empty_cache()
            parts[titles[name]] = module.markdown([r for r in rows if r["section"] == module.NAME])
            write(out, parts, rows, meta)
    meta["elapsed_s"] = round(time.monotonic() - started, 1)
    write(out, parts, rows, meta)
    print((out / "bench.md").read_text())
    if meta["errors"]:
        progress(f"{len(meta['errors'])} error(s); the first: {meta['errors'][0]}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu"))
    parser.add_argument("--time-limit", type=float, default=600.0,
                        help="seconds for the whole benchmark; cases left when it is near are reported as not measured")
    parser.add_argument("--sections", nargs="+", choices=warm.SECTIONS, default=list(warm.SECTIONS))
    parser.add_argument("--warm-jobs", type=int, default=min(12, os.cpu_count() or 1),
                        help="parallel processes compiling the Triton kernels first (0: none)")
    parser.add_argument("--keep-going", action="store_true", default=os.environ.get("GPU_CHECK_KEEP_GOING") == "1",
                        help="after a wrong result or a failed call, go on with the other cases")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device (torch.cuda.is_available() is False): this benchmark needs a GPU; nothing measured",
              file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1: the Triton rows would time the interpreter; run with TRITON_INTERPRET=0",
              file=sys.stderr)
        return 2
    return run(args.out, args.time_limit, args.sections, args.warm_jobs, args.keep_going)


if __name__ == "__main__":
    sys.exit(main())
