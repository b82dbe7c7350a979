"""The report of ``make gpu-check``: ``report.md`` from what the stages left in the working folder.

``bench/gpu/check.sh`` records one row per stage in ``stages.tsv`` (stage, status, seconds, note, finished,
commit; status PASS, FAIL, TIMEOUT, SKIPPED, NOT RUN, or RUNNING while the stage runs) and each stage's
output in ``<stage>.log``, in its working folder, and calls this module before and after every stage (so
that a run cut off anywhere still has its report); the env stage writes ``env.txt``, the bench stage
``bench.md``, the tests and sanitize stages pytest progress records (``*.progress``, summarised first in
their sections by :mod:`bench.gpu.pytest_progress`: a stopped pytest prints no summary). This module
(standard library only: it must run when torch cannot be imported) turns them into one Markdown file,
with the card and versions first so that the figures can be copied into ``bench/results/gpu.md`` as they
are, and prints the stage summary. Rows from earlier runs (stages run separately) are kept and marked
when their commit differs from the newest row's.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from bench.gpu import pytest_progress

ORDER = ("env", "build", "tests", "sanitize", "bench", "suite")
#: Lines of a passing stage's log worth keeping in the report (the log has the rest).
KEY_LINES = {
    "build": r"^(TORCH_CUDA_ARCH_LIST=|no cusparse|attn_ext imported|CUDA kernels registered|images in|this card|"
             r"cuobjdump not found|error:)",
    "tests": r"^(\d+ (passed|failed)|=+ .*(passed|failed|error)|SKIPPED|FAILED|ERROR)",
    "sanitize": r"^(== |OK|.*ERROR SUMMARY|.*cannot run|error)",
    "suite": r"^(\d+ (passed|failed)|=+ .*(passed|failed|error)|FAILED|ERROR)",
}
FAILURE_TAIL = 40
#: The progress records of the pytest runs of a stage (bench/gpu/pytest_progress.py): which tests had not
#: finished when the stage was stopped, and the slowest ones.
PROGRESS = {"tests": "tests.progress", "sanitize": "sanitize-*.progress"}


def read_stages(out: Path) -> dict[str, dict[str, str]]:
    rows = {}
    path = out / "stages.tsv"
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) == 6:
                rows[parts[0]] = dict(zip(("stage", "status", "seconds", "note", "finished", "commit"), parts))
    return rows


def read_env(out: Path) -> dict[str, str]:
    path = out / "env.txt"
    if not path.exists():
        return {}
    return dict(line.split(": ", 1) for line in path.read_text().splitlines() if ": " in line)


def _log(out: Path, stage: str) -> list[str]:
    path = out / f"{stage}.log"
    return path.read_text(errors="replace").splitlines() if path.exists() else []


def stage_section(out: Path, row: dict[str, str]) -> list[str]:
    stage, lines = row["stage"], _log(out, row["stage"])
    head = [f"## {stage}: {row['status']}" + (f" ({row['note']})" if row["note"] else ""), ""]
    if stage == "env":
        return head + ["```text", *lines, "```", ""]
    if stage == "bench" and (out / "bench.md").exists():
        # The tables already hold their headings; one level down under this stage.
        tables = [("#" + line) if line.startswith("#") else line for line in (out / "bench.md").read_text().splitlines()]
        extra = ["", "Last lines of bench.log:", "", "```text", *lines[-FAILURE_TAIL:], "```"] \
            if row["status"] in ("FAIL", "TIMEOUT", "RUNNING") else []
        return head + tables + extra + [""]
    pattern = KEY_LINES.get(stage)
    kept = [line for line in lines if pattern and re.search(pattern, line)]
    if row["status"] in ("FAIL", "TIMEOUT", "RUNNING"):
        kept += ["", f"(last {FAILURE_TAIL} lines of {stage}.log)", *lines[-FAILURE_TAIL:]]
    records = sorted(out.glob(PROGRESS[stage])) if stage in PROGRESS else []
    progress = [line for path in records
                for line in pytest_progress.summary_lines(pytest_progress.read(path), path.name)]
    return (head + (["```text", *progress, "```", ""] if progress else [])
            + (["```text", *kept, "```"] if kept else [f"(see {stage}.log)"]) + [""])


def render(out: Path, stages_run: list[str], elapsed: str | None) -> tuple[str, str]:
    """``(report Markdown, console summary)``."""
    rows, env = read_stages(out), read_env(out)
    newest = max(rows.values(), key=lambda r: r["finished"])["commit"] if rows else "unknown"
    card = env.get("card", "no GPU found")
    title = f"# attn_ext GPU check: {card}" + (f" (compute capability {env['capability']})" if "capability" in env else "")
    facts = [f"{key} {env[key]}" for key in ("torch", "triton", "nvcc", "driver") if key in env]
    lines = [title, "",
             "; ".join([f"Commit {newest}", *facts] + ([f"torch's CUDA {env['torch_cuda']}"] if "torch_cuda" in env else [])),
             f"Last command: `bash bench/gpu/check.sh {' '.join(stages_run)}`"
             + (f", {elapsed} s end to end." if elapsed else "."), "",
             "| stage | result | seconds | note | finished (UTC) | commit |", "| --- | --- | ---: | --- | --- | --- |"]
    summary = [f"gpu-check ({card}):"]
    for stage in ORDER:
        row = rows.get(stage)
        if row is None:
            continue
        stale = " (earlier commit)" if row["commit"] != newest else ""
        lines.append(f"| {stage} | **{row['status']}** | {row['seconds']} | {row['note']} | {row['finished']} | "
                     f"{row['commit']}{stale} |")
        summary.append(f"  {stage:9s} {row['status']:8s} {row['seconds']:>5s} s  {row['note']}{stale}")
    missing = [s for s in ORDER[:-1] if s not in rows or rows[s]["status"] != "PASS"]
    lines += ["", "Not validated by this report: " + (", ".join(missing) if missing else "nothing (every default stage "
                                                        "passed)") + ".", ""]
    for stage in ORDER:
        if stage in rows and rows[stage]["status"] != "NOT RUN":
            lines += stage_section(out, rows[stage])
    return "\n".join(lines), "\n".join(summary)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--stages", nargs="*", default=[])
    parser.add_argument("--elapsed", default=None)
    parser.add_argument("--quiet", action="store_true", help="write report.md only (the report between stages)")
    args = parser.parse_args(argv)
    report, summary = render(args.out, [s for s in args.stages if s], args.elapsed)
    (args.out / "report.md").write_text(report + "\n")
    if not args.quiet:
        print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
