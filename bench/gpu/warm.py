"""Compile what the GPU benchmark's first cases will compile, in parallel processes, before it times anything.

Two kinds of compile cost the timing process its minutes when it meets them itself, one core at a time:

- **Triton's autotuning**: each (kernel, dtype, head dim, code path) compiles every tile config its pruning
  keeps, about a second each: 27-49 compiles for the forward and the backward's three kernels of one attention
  case (fewer where the spill table drops the configs that spill). They do not depend on the sequence length
  (the attention section's ``warm_case`` gives the smallest case that compiles the same kernels), so the cases are first reduced to the distinct ones, and each worker
  compiles its share of every kernel's configs (config ``i`` of the pruned list goes to worker ``i mod n``):
  ``python -m bench.gpu.warm triton SHARE SHARES CASE_ID ...``. The sections without a ``warm_case`` (they
  come after every attention case) are not warmed.
- **FlexAttention** (``torch.compile``): a compile per shape and pass, one process per case
  (``python -m bench.gpu.warm flex CASE_ID``), for the first cases that run it.

Both kinds write their results to caches on disk (Triton's; Inductor's FX graph, AOTAutograd and Triton
caches), where the timing process finds them. On the H200 (2026-11-28) the former warm-up gave each of the
12 bf16 cases one process that compiled its case's configs one after another (three cases per (D, causal),
each compiling the same kernels), and half of them were still at it at the 66 s limit; FlexAttention was not
warmed at all: the first case (bf16 D=128 N=4096) took 40.3 s, and 11.9 s in a second run on the same machine
with its compiles cached.

Workers run before the timing, never beside it (their launches would share the card with the timed calls),
under a time limit that the caller sets; a worker stopped at the limit keeps what it compiled (each kernel and
graph is written to its cache as it is compiled). A worker that fails only costs the timing process the
compiles it had to do; its error is reported in the summary.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from bench.gpu.plan import Planned, planned
from bench.gpu.timing import compile_only_autotuning


@dataclass(frozen=True)
class Job:
    """One worker process: ``kind`` "triton" (its share ``share`` of ``shares`` of each kernel's configs,
    for every case of ``case_ids``) or "flex" (one case)."""

    kind: str
    case_ids: tuple[str, ...]
    share: int = 0
    shares: int = 1

    def argv(self) -> list[str]:
        if self.kind == "triton":
            return [sys.executable, "-m", "bench.gpu.warm", "triton", str(self.share), str(self.shares),
                    *self.case_ids]
        return [sys.executable, "-m", "bench.gpu.warm", "flex", *self.case_ids]


def stand_in(p: Planned):
    """The case whose Triton calls compile what ``p``'s do (its section's ``warm_case``)."""
    return p.module.warm_case(p.case)


def distinct_compiles(cases: list[Planned]) -> list[Planned]:
    """The first of ``cases`` for each distinct set of Triton compiles (equal stand-ins), in their order; only
    the sections that name a stand-in (``warm_case``): the others' Triton calls run at their full size, which
    every worker would repeat, and they come after every attention case anyway."""
    kept: list[Planned] = []
    for p in cases:
        if hasattr(p.module, "warm_case") and not any(q.section == p.section and stand_in(q) == stand_in(p)
                                                      for q in kept):
            kept.append(p)
    return kept


def plan_jobs(cases: list[Planned], jobs: int) -> list[Job]:
    """The worker processes for ``cases``: one per case that runs FlexAttention, first cases first, for at
    most half of ``jobs``; the rest (at least one) share the Triton compiles of :func:`distinct_compiles`."""
    flex = [p for p in cases if getattr(p.module, "has_flex", lambda case: False)(p.case)][:max(jobs, 1) // 2]
    ids = tuple(p.id for p in distinct_compiles(cases))
    shares = max(1, jobs - len(flex)) if ids else 0
    return [Job("triton", ids, share, shares) for share in range(shares)] + [Job("flex", (p.id,)) for p in flex]


#: The environment of each kind of worker, over the benchmark's own. Triton workers: their tuning results are
#: meaningless (each times a share of the configs), never stored for the timing process. FlexAttention
#: workers: Inductor compiles in-process (its default pool would start a process per core in each worker);
#: the pool size is not part of Inductor's cache keys. Both: one CPU thread, the cores are the compiles'.
ENVIRONMENT = {"triton": {"TRITON_CACHE_AUTOTUNING": "0"}, "flex": {"TORCHINDUCTOR_COMPILE_THREADS": "1"}}


def warm_in_parallel(cases: list[Planned], jobs: int, time_limit_s: float) -> str:
    """Runs :func:`plan_jobs`' workers for ``cases`` and returns a one-line summary; workers still running
    after ``time_limit_s`` are stopped."""
    planned_jobs = plan_jobs(cases, jobs)
    started = time.monotonic()
    workers = [(job, subprocess.Popen(job.argv(), env={**os.environ, "OMP_NUM_THREADS": "1", **ENVIRONMENT[job.kind]},
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
               for job in planned_jobs]
    stopped, failures = [], []
    for job, worker in workers:
        try:
            output, _ = worker.communicate(timeout=max(1.0, time_limit_s - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.communicate()
            stopped.append(job.kind)
            continue
        if worker.returncode:
            failures.append(output.strip().splitlines()[-1] if output.strip() else f"exit status {worker.returncode}")
    triton = [j for j in planned_jobs if j.kind == "triton"]
    flex = len(planned_jobs) - len(triton)
    summary = (f"Warm-up: the Triton compiles of {len(triton[0].case_ids) if triton else 0} distinct case(s) of "
               f"{len(cases)} shared by {len(triton)} process(es), FlexAttention for {flex} case(s) one process "
               f"each, {time.monotonic() - started:.0f} s")
    if stopped:
        failures.insert(0, f"{len(stopped)} worker(s) ({', '.join(sorted(set(stopped)))}) stopped at the "
                           f"{time_limit_s:.0f} s limit (what they compiled is kept)")
    return summary + (f"; problems: {'; '.join(failures)}" if failures else "")


def _keep_share_of_configs(share: int, shares: int) -> None:
    """Makes every Triton autotuner of this process keep config ``i`` of its pruned list only where
    ``i % shares == share``; a kernel with fewer configs than workers keeps one, ``share % len``, so that the
    duplicates spread over its configs."""
    from triton.runtime.autotuner import Autotuner  # Triton is optional: this module imports without it

    prune = Autotuner.prune_configs

    def mine(self, *args, **kwargs):
        configs = prune(self, *args, **kwargs)
        return configs[share::shares] or [configs[share % len(configs)]]

    Autotuner.prune_configs = mine


def _run(ids: list[str], work: str) -> int:
    """``module.triton_work`` of each case's stand-in, or ``module.flex_work`` of the case itself."""
    failed = 0
    for case_id in ids:
        p = planned(case_id)
        try:
            if work == "triton_work":
                p.module.triton_work(stand_in(p))
            else:
                p.module.flex_work(p.case)
        except Exception as exc:  # noqa: BLE001 - the timing process meets and reports it properly
            print(f"warm-up of {case_id} ({work}) failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            failed += 1
        # Give the memory back: the workers share the GPU, each would otherwise keep its largest case's.
        torch.cuda.empty_cache()
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "triton":
        share, shares, ids = int(argv[1]), int(argv[2]), argv[3:]
        problem = compile_only_autotuning()
        if problem:
            print(f"cannot skip the tuning in the warm-up worker ({problem}): it tunes as well", file=sys.stderr)
        _keep_share_of_configs(share, shares)
        return _run(ids, "triton_work")
    if argv and argv[0] == "flex":
        return _run(argv[1:], "flex_work")
    print("usage: python -m bench.gpu.warm triton SHARE SHARES CASE_ID ... | flex CASE_ID ...", file=sys.stderr)
    return 64


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
