"""Ahead-of-time compile of every Triton kernel of attn_ext for sm_80 and sm_90, without a GPU.

Each Triton launcher of the package is called with CPU tensors of every dtype and representative head
dims (``triton_aot_cases``); its launches are recorded instead of run, the autotuned ones through the
package's own pruning with the target's shared memory (``triton_aot_capture``), and each recorded
launch is compiled for the target as a launch on that card would compile it (``triton_aot_compile``).

Fails (exit 1) on any compile error, on a kept config whose shared memory exceeds the target's
per-block limit (sm_80: 166912 bytes, sm_90: 232448), on a compile running past ``--timeout``, on
a kernel of the package that no case launches, and when the machine code of an attention kernel
breaks a criterion of issue 43 outside the known gaps, or a known gap now holds (``sass_criteria``).
Writes the table kernel × config × dtype/dims × target → registers, shared memory, stack (spills) and
opcode counts to ``bench/out/triton_aot.md`` and prints a summary.

Usage::

    python bench/gpu/triton_aot.py                  # the CI scope, both targets
    python bench/gpu/triton_aot.py --scope full     # every kept config of every case (long when cold)
    python bench/gpu/triton_aot.py --scope sass     # the attention kernels' every kept config (make sass-report)
    python bench/gpu/triton_aot.py --targets sm_90 --list   # the jobs, without compiling
    python bench/gpu/triton_aot.py --targets sm_90 --cases '^attention .*D=128'   # a subset of the cases

Results are cached in ``~/.cache/attn_ext/triton_aot`` (``--cache-dir``), keyed by the kernel's source
hash, the job and the Triton version.
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "bench" / "out" / "triton_aot.md"
CACHE = Path.home() / ".cache" / "attn_ext" / "triton_aot"


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="sm_80,sm_90", help="comma-separated, of sm_80, sm_90")
    p.add_argument("--scope", choices=("ci", "sass", "full"), default="ci",
                   help="ci: every kept config per element size and tile width, every case once; sass: every "
                        "kept config of the attention kernels at fp16/bf16, D = 64 and 128; full: all")
    p.add_argument("--kernels", default="", help="only the kernels whose name matches this regular expression")
    p.add_argument("--cases", default="",
                   help="only the cases whose 'family dtype dims' matches this regular expression (e.g. "
                        "'^attention .* D=128'); the check for kernels without a case is then skipped")
    p.add_argument("--jobs", type=int, default=2, help="compiles at a time (default 2)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one compile may take (default 600)")
    p.add_argument("--cache-dir", type=Path, default=CACHE, help=f"default {CACHE}")
    p.add_argument("--no-cache", action="store_true", help="compile everything, read and write no cached result")
    p.add_argument("--out", type=Path, default=OUT, help=f"the Markdown table (default {OUT.relative_to(ROOT)})")
    p.add_argument("--list", action="store_true", help="print the jobs and exit without compiling")
    p.add_argument("--rows-json", type=Path, default=None,
                   help="also write each compile's kernel, target, options, dtypes and resources as JSON "
                        "(read by spill_table.py)")
    args = p.parse_args(argv)
    from triton_aot_target import TARGETS  # beside this file: importable once main() put it on sys.path

    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not args.targets or any(t not in TARGETS for t in args.targets):
        p.error(f"--targets must name some of {', '.join(TARGETS)}, got {','.join(args.targets) or 'none'}")
    return args


def _setup_environment() -> None:
    # The kernels must be decorated as compiled kernels, not interpreter objects: before any import
    # of attn_ext. Spawned compile workers inherit this environment.
    os.environ.pop("TRITON_INTERPRET", None)
    # Every kept config of every autotuned kernel, not the one that ATTN_EXT_TRITON_PIN=1 would run.
    os.environ.pop("ATTN_EXT_TRITON_PIN", None)
    # Triton's own cache (every IR of every compile, ~1 MB each) would only repeat the result cache: a
    # scratch directory for this run.
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="attn_ext_triton_aot_")
    atexit.register(shutil.rmtree, os.environ["TRITON_CACHE_DIR"], ignore_errors=True)
    # This checkout's attn_ext, whatever else is installed.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    here = str(Path(__file__).resolve().parent)  # the triton_aot_* modules beside this file
    if here not in sys.path:
        sys.path.insert(0, here)
    args = _parse(argv)
    _setup_environment()
    try:
        import triton  # optional: checked here, after _setup_environment, so that its absence is reported
    except Exception as exc:  # noqa: BLE001 - any broken install
        print(f"triton_aot: Triton is not importable ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    # The triton_aot_* modules beside this file, imported only now: importable once their folder is on sys.path,
    # and loaded after _setup_environment, since what they import of attn_ext decorates its Triton kernels
    # (reading TRITON_INTERPRET) when first imported.
    from triton_aot_capture import capture, dot_kernels, kernel_hashes, uncovered_kernels
    from triton_aot_cases import all_cases, select
    from triton_aot_compile import ResultCache, compile_job, job_key
    from triton_aot_pool import run_pool
    from triton_aot_report import Row, summary, table
    from triton_aot_sass import ci_cover, group_table, judge, report_lines
    from triton_aot_target import TARGETS

    start = time.perf_counter()
    targets = [TARGETS[name] for name in args.targets]
    cases = [c for c in all_cases() if re.search(args.cases, f"{c.family} {c.dtype} {c.dims}")]
    captured = {}
    for target in targets:
        captured.update(capture(target, cases))
    missing = [] if args.cases else uncovered_kernels(captured, args.targets)
    jobs = select(captured, args.scope, dot_kernels())
    # What CI's scope leaves out of the machine-code report's (said in the report, not guessed).
    cover = ci_cover(jobs, select(captured, "ci", dot_kernels())) if args.scope == "sass" else []
    if args.kernels:
        jobs = {job: c for job, c in jobs.items() if re.search(args.kernels, job.kernel)}
    if args.list:
        for job, job_cases in jobs.items():
            print(job.target, job.kernel, job.config(), "|", ", ".join(f"{c.dtype} {c.dims}" for c in job_cases))
        print(f"{len(jobs)} jobs ({len(captured)} captured)")
        return 0

    hashes = kernel_hashes(jobs)
    cache = ResultCache(None if args.no_cache else args.cache_dir / "results")
    order = list(jobs)
    keys = [job_key(dataclasses.asdict(job), hashes[job.module, job.kernel]) for job in order]
    results: dict[int, dict] = {}
    for i, key in enumerate(keys):
        if (hit := cache.get(key)) is not None:
            results[i] = hit
    hits = len(results)
    todo = [i for i in range(len(order)) if i not in results]
    print(f"triton_aot: Triton {triton.__version__}, {len(order)} compiles ({hits} cached, {len(todo)} to do) "
          f"for {', '.join(t.name for t in targets)}, {args.jobs} at a time", flush=True)

    done = [0]

    def on_result(k: int, result: dict) -> None:
        i = todo[k]
        results[i] = result
        cache.put(keys[i], result)
        done[0] += 1
        if done[0] % 25 == 0 or done[0] == len(todo) or "error" in result:
            job = order[i]
            status = "FAILED " + result["error"].splitlines()[0][:200] if "error" in result else "ok"
            print(f"  [{done[0]}/{len(todo)}, {time.perf_counter() - start:.0f} s] {job.target} {job.kernel} "
                  f"{job.config()}: {status}", flush=True)

    # A SIGTERM (CI's time limit) unwinds like an exception, so that the pool stops its workers.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    run_pool(compile_job, [dataclasses.asdict(order[i]) for i in todo], args.jobs, args.timeout, on_result)

    rows = [Row(job, jobs[job], results[i], TARGETS[job.target]) for i, job in enumerate(order)]
    elapsed = time.perf_counter() - start
    header = (f"Triton {triton.__version__}; scope {args.scope}; {len(rows)} compiles, {hits} from the cache; "
              f"{elapsed:.0f} s with {args.jobs} workers")
    # Known gaps are judged over a whole scope only: a subset may leave out the compiles where a gap fails.
    found = judge(rows, judge_gaps=not (args.cases or args.kernels))
    verdict = report_lines(found)
    machine_code = "\n".join(["## Machine code (issue 43)", "", *[f"- {line}" for line in verdict + cover], "",
                               group_table(rows, found)])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table(rows, header, missing, machine_code))
    if args.rows_json is not None:
        args.rows_json.write_text(json.dumps(
            [{"kernel": r.job.kernel, "target": r.job.target, "options": dict(r.job.options),
              "dtypes": sorted({c.dtype for c in r.cases}), "dims": sorted({c.dims for c in r.cases}),
              "resources": {k: r.result.get(k) for k in ("regs", "stack", "local", "shared")},
              "error": r.result.get("error")} for r in rows], indent=0))
    text, failed = summary(rows, missing)
    print(text)
    if args.scope == "sass":
        print(group_table(rows, found))
    print("\n".join(verdict + cover))
    print(f"triton_aot: {header}; table in {args.out}")
    return 1 if failed or any(f.failed for f in found) else 0


if __name__ == "__main__":
    sys.exit(main())
