"""Compile the Triton kernels of the GPU benchmark's first cases in parallel processes before it times anything.

Each (kernel, tiles, dtype, shape bucket) the benchmark reaches is a Triton autotuning key, and tuning one
compiles every tile configuration the pruning keeps, one after the other, about a second each: tens of
seconds of a single CPU core per attention case, while the card and the other cores wait. This gives the
first cases of the run's order (:mod:`bench.gpu.plan`: the goal rows first) one worker process each
(``python -m bench.gpu.warm SECTION:INDEX``), which runs the case's Triton calls once with
:func:`bench.gpu.timing.compile_only_autotuning`, so that the compiled kernels are in Triton's on-disk cache
when the timing process tunes (it then only times the tiles). Nothing measured here is kept; a worker that
fails only costs the timing process its compile time, and its error is reported.

Why only the first cases, one each, under a time limit: a run measured on an H200 gave the whole grid (47
cases) to 12 workers, about 4 each, and its workers were still compiling cases the timing never reached
when their limit (half the budget) stopped them. One case per worker needs the least wall time; the
first cases are the ones the timing reaches; what a stopped worker finished compiling stays in the cache
(Triton writes each kernel as it is compiled), so a limit that cuts a worker short still leaves the
timing process less to compile. The caller keeps the limit to a third of its budget or so. The workers
run before the timing, never beside it: their launches would share the card with the timed calls.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from bench.gpu.plan import Planned, planned
from bench.gpu.timing import compile_only_autotuning


def warm_in_parallel(cases: list[Planned], jobs: int, time_limit_s: float) -> str:
    """Runs one worker for each of the first ``jobs`` of ``cases`` and returns a one-line summary; workers
    still running after ``time_limit_s`` are stopped."""
    ids = [p.id for p in cases[:jobs]]
    # The tuning results of these workers are meaningless: never let Triton store them for the timing process.
    env = {**os.environ, "TRITON_CACHE_AUTOTUNING": "0"}
    started = time.monotonic()
    workers = [subprocess.Popen([sys.executable, "-m", "bench.gpu.warm", case_id], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for case_id in ids]
    stopped, failures = 0, []
    for worker in workers:
        try:
            output, _ = worker.communicate(timeout=max(1.0, time_limit_s - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.communicate()
            stopped += 1
            continue
        if worker.returncode:
            failures.append(output.strip().splitlines()[-1] if output.strip() else f"exit status {worker.returncode}")
    summary = (f"Triton warm-up: the first {len(ids)} of {len(cases)} cases, one process each, "
               f"{time.monotonic() - started:.0f} s")
    if stopped:
        failures.insert(0, f"{stopped} worker(s) stopped at the {time_limit_s:.0f} s limit "
                           "(what they compiled is kept)")
    return summary + (f"; problems: {'; '.join(failures)}" if failures else "")


def main(ids: list[str]) -> int:
    problem = compile_only_autotuning()
    if problem:
        print(f"cannot skip the tuning in the warm-up worker ({problem}): it tunes as well", file=sys.stderr)

    failed = 0
    for case_id in ids:
        case = planned(case_id)
        try:
            case.module.triton_work(case.case)
        except Exception as exc:  # noqa: BLE001 - the timing process meets and reports it properly
            print(f"warm-up of {case_id} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            failed += 1
        # Give the memory back: a dozen workers share the GPU, each would otherwise keep its largest case's.
        torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
