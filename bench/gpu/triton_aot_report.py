"""The Triton AOT check's findings: one row per compile, the Markdown table and the printed summary."""
from __future__ import annotations

from dataclasses import dataclass

from sass_opcodes import COUNTS

__all__ = ["Row", "summary", "table"]


@dataclass
class Row:
    job: object  # triton_aot_capture.Job
    cases: list  # the triton_aot_cases.Case objects that launch it
    result: dict  # triton_aot_compile.compile_job's
    target: object  # triton_aot_target.Target

    @property
    def problem(self) -> str | None:
        """Why this compile fails the check, or None."""
        if "error" in self.result:
            return self.result["error"]
        if self.result["shared"] > self.target.max_shared:
            return (f"needs {self.result['shared']} bytes of shared memory, over the {self.target.max_shared} "
                    f"of {self.target.name}")
        return None

    def dtypes(self) -> str:
        return "/".join(dict.fromkeys(case.dtype for case in self.cases))

    def dims(self) -> str:
        return "; ".join(dict.fromkeys(case.dims for case in self.cases))

    @property
    def counts(self) -> dict:
        """The kernel's opcode counts (:func:`sass_opcodes.opcode_counts`); empty when the compile failed."""
        return self.result.get("sass", {})


def _cells(row: Row) -> list[str]:
    r = row.result
    resources = ["-"] * 3 if "error" in r else [str(r["regs"]), str(r["shared"]), str(r["stack"])]
    counts = [str(row.counts[name]) if name in row.counts else "-" for name in COUNTS]
    return [row.job.kernel, row.job.config(), row.job.variant(), row.dtypes(), row.dims(), row.job.target, *resources,
            *counts, f"{r.get('seconds', 0):.1f}", "ok" if row.problem is None else "**FAIL**"]


def table(rows: list[Row], header: str, missing: list[str], section: str = "") -> str:
    """The full table (Markdown), failures first, then by kernel, target and config; ``section`` (Markdown)
    before it."""
    lines = ["# Triton kernels compiled ahead of time", "",
             "Written by `bench/gpu/triton_aot.py` (no GPU needed). " + header + ".", "",
             "regs: registers per thread; smem: dynamic shared memory per block (bytes, the launch's request);",
             "stack: local memory per thread (bytes), where ptxas spills: 0 means no spill. "
             "w/s: warps and pipeline stages (`-`: Triton's default, 4 warps and 3 stages); variant: the",
             "launcher's other constexprs (its code path). Then the kernel's static instruction counts from",
             "`cuobjdump -sass` (`bench/gpu/sass_opcodes.py`; each instruction once, loops not unrolled).", ""]
    failures = [row for row in rows if row.problem is not None]
    if failures or missing:
        lines += ["## Failures", ""]
        lines += [f"- kernel `{name}`: no case launches it; add one to `bench/gpu/triton_aot_cases.py`"
                  for name in missing]
        lines += [f"- `{row.job.kernel}` {row.job.config()} {row.job.variant()} {row.dtypes()} {row.dims()} "
                  f"{row.job.target}: {row.problem}" for row in failures]
        lines.append("")
    if section:
        lines += [section, "## Every compile", ""]
    lines += ["| kernel | config | variant | dtype | dims | target | regs | smem | stack | "
              + " | ".join(COUNTS) + " | compile s | status |",
              "|---|---|---|---|---|---|--:|--:|--:|" + "--:|" * len(COUNTS) + "--:|---|"]
    ordered = sorted(rows, key=lambda row: (row.problem is None, row.job.kernel, row.job.target, row.job.config()))
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in ordered]
    return "\n".join(lines) + "\n"


def summary(rows: list[Row], missing: list[str]) -> tuple[str, bool]:
    """A compact table (one line per kernel and target) and whether anything failed."""
    groups: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.job.kernel, row.job.target), []).append(row)
    lines = [f"{'kernel':28} {'target':6} {'compiles':>8} {'max regs':>8} {'max smem':>9} {'limit':>7} "
             f"{'stack>0':>8} {'max stack':>9} {'failed':>6}"]
    for (kernel, target), group in sorted(groups.items()):
        good = [row.result for row in group if "error" not in row.result]
        spilling = sum(1 for r in good if r["stack"] > 0)
        failed = sum(1 for row in group if row.problem is not None)
        lines.append(f"{kernel:28} {target:6} {len(group):8d} {max((r['regs'] for r in good), default=0):8d} "
                     f"{max((r['shared'] for r in good), default=0):9d} {group[0].target.max_shared:7d} "
                     f"{spilling:8d} {max((r['stack'] for r in good), default=0):9d} {failed:6d}")
    failures = [row for row in rows if row.problem is not None]
    for name in missing:
        lines.append(f"FAIL: kernel {name} has no AOT case (bench/gpu/triton_aot_cases.py)")
    for row in failures:
        first = row.problem.splitlines()[0][:300]
        lines.append(f"FAIL: {row.job.kernel} {row.job.config()} {row.job.variant()} {row.dtypes()} {row.dims()} "
                     f"{row.job.target}: {first}")
    return "\n".join(lines), bool(failures or missing)
