"""Compile the Triton kernels of the GPU benchmark in parallel processes before it times anything.

Each (kernel, tiles, dtype, shape bucket) the benchmark reaches is a Triton autotuning key, and tuning one
compiles every tile configuration the pruning keeps, one after the other, about a second each: over the
whole grid, minutes of a single CPU core. This spreads the benchmark's cases over worker processes
(``python -m bench.gpu.warm SECTION:INDEX ...``), each running the Triton calls of its cases once with
:func:`bench.gpu.timing.compile_only_autotuning`, so that the compiled kernels are in Triton's on-disk cache
when the timing process tunes (it then only times the tiles). Nothing measured here is kept; a worker that
fails only costs the timing process its compile time, and its error is reported.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from importlib import import_module

import torch

from bench.gpu.timing import compile_only_autotuning

#: The benchmark sections, in the order they run (module names under bench.gpu).
SECTIONS = ("attention", "states", "tree", "other_ops")


def section(name: str):
    return import_module(f"bench.gpu.{name}")


def all_cases(sections=SECTIONS) -> list[str]:
    """``SECTION:INDEX`` of every case of the sections."""
    return [f"{name}:{i}" for name in sections for i in range(len(section(name).cases()))]


def warm_in_parallel(sections, jobs: int, time_limit_s: float) -> str:
    """Runs the workers (the cases of ``sections`` dealt round-robin over ``jobs`` processes) and returns
    a one-line summary; workers still running after ``time_limit_s`` are stopped."""
    ids = all_cases(sections)
    chunks = [ids[i::jobs] for i in range(jobs) if ids[i::jobs]]
    # The tuning results of these workers are meaningless: never let Triton store them for the timing process.
    env = {**os.environ, "TRITON_CACHE_AUTOTUNING": "0"}
    started = time.monotonic()
    workers = [subprocess.Popen([sys.executable, "-m", "bench.gpu.warm", *chunk], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for chunk in chunks]
    failures = []
    for worker in workers:
        try:
            output, _ = worker.communicate(timeout=max(1.0, time_limit_s - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            worker.kill()
            output, _ = worker.communicate()
            failures.append(f"a worker was stopped at the {time_limit_s:.0f} s limit")
        if worker.returncode:
            failures.append(output.strip().splitlines()[-1] if output.strip() else f"exit status {worker.returncode}")
    summary = f"Triton warm-up: {len(ids)} cases in {len(chunks)} processes, {time.monotonic() - started:.0f} s"
    return summary + (f"; problems: {'; '.join(failures)}" if failures else "")


def main(ids: list[str]) -> int:
    problem = compile_only_autotuning()
    if problem:
        print(f"cannot skip the tuning in the warm-up worker ({problem}): it tunes as well", file=sys.stderr)

    failed = 0
    for case_id in ids:
        name, index = case_id.split(":")
        module = section(name)
        try:
            module.triton_work(module.cases()[int(index)])
        except Exception as exc:  # noqa: BLE001 - the timing process meets and reports it properly
            print(f"warm-up of {case_id} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            failed += 1
        # Give the memory back: a dozen workers share the GPU, each would otherwise keep its largest case's.
        torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
