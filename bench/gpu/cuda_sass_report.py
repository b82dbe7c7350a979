"""The CUDA machine-code report's text: the per-instantiation Markdown table (``bench/out/cuda_sass.md``)
and the printed summary (one line per kernel, dtype and target, then the gaps and the failures)."""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from sass_criteria import FAILURES, GAP, Finding, SassRow
from sass_opcodes import COUNTS

_RESOURCES = ("regs", "spill_stores", "spill_loads", "stack", "shared", "local")
_HEADER = ("regs", "spill st/ld B", "stack B", "static smem B")


def _resources(row: SassRow) -> list[str]:
    r = row.resources
    spills = f"{r['spill_stores']}/{r['spill_loads']}" if "spill_stores" in r else "?"
    return [str(r.get("regs", "?")), spills, str(r.get("stack", "?")), str(r.get("shared", "?"))]


def _verdicts(results: Iterable[Finding]) -> dict[tuple[str, str, str], str]:
    """Per (kernel, target, config): "ok", or the requirements that are gaps or failures."""
    notes: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for f in results:
        key = (f.kernel, f.target, f.config)
        notes.setdefault(key, [])
        if f.status == GAP:
            notes[key].append(f"gap: {f.requirement}")
        elif f.status in FAILURES:
            notes[key].append(f"**{f.status}**: {f.requirement}".rstrip(": "))
    return {k: "; ".join(v) or "ok" for k, v in notes.items()}


def _sort_key(row: SassRow):
    return row.kernel, row.config.split(" ")[0], row.target, row.config


def table(rows: list[SassRow], results: list[Finding]) -> list[str]:
    verdicts = _verdicts(results)
    lines = ["| kernel | config | target | " + " | ".join(_HEADER) + " | " + " | ".join(COUNTS) + " | criteria |",
             "|---|---|---|" + "--:|" * (len(_HEADER) + len(COUNTS)) + "---|"]
    for row in sorted(rows, key=_sort_key):
        counts = [str(row.counts.get(name, "-")) for name in COUNTS]
        verdict = verdicts.get((row.kernel, row.target, row.config), "ok")
        lines.append(f"| {row.kernel} | {row.config} | {row.target} | " + " | ".join(_resources(row) + counts)
                     + f" | {verdict} |")
    return lines


def _span(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def grouped(rows: list[SassRow]) -> list[str]:
    """One line per kernel, dtype and target: the range of each resource and count over its instantiations."""
    groups: dict[tuple[str, str, str], list[SassRow]] = defaultdict(list)
    for row in rows:
        groups[(row.kernel, row.config.split(" ")[0], row.target)].append(row)
    lines = ["| kernel | dtype | target | n | regs | spill st B | stack B | static smem B | "
             + " | ".join(COUNTS) + " |", "|---|---|---|--:|" + "--:|" * (4 + len(COUNTS))]
    for (kernel, dtype, target), members in sorted(groups.items()):
        res = [_span([m.resources.get(k, 0) for m in members]) for k in ("regs", "spill_stores", "stack", "shared")]
        counts = [_span([m.counts.get(name, 0) for m in members]) for name in COUNTS]
        lines.append(f"| {kernel} | {dtype} | {target} | {len(members)} | " + " | ".join(res + counts) + " |")
    return lines


def gap_lines(results: list[Finding]) -> list[str]:
    """Each known gap that matched: requirement, kernel, target, how many instantiations, and why."""
    gaps: dict[tuple[str, str, str, str], list[Finding]] = defaultdict(list)
    for f in results:
        if f.status == GAP:
            gaps[(f.kernel, f.config.split(" ")[0], f.target, f.requirement)].append(f)
    return [f"- gap (issue 43): {kernel} {dtype} {target}: {req} fails in {len(fs)} instantiations "
            f"(is {_span([f.actual for f in fs if f.actual is not None] or [0])}): {fs[0].why}"
            for (kernel, dtype, target, req), fs in sorted(gaps.items())]


def failure_lines(results: list[Finding]) -> list[str]:
    return [f"- {f}" for f in results if f.status in FAILURES]


def _totals(rows: list[SassRow], results: list[Finding]) -> str:
    statuses = defaultdict(int)
    for f in results:
        statuses[f.status] += 1
    return (f"{len(rows)} kernel instantiations x targets; findings: "
            + ", ".join(f"{n} {s}" for s, n in sorted(statuses.items())))


def markdown(rows: list[SassRow], results: list[Finding], origin: str, seconds: float) -> str:
    failures = failure_lines(results)
    return "\n".join([
        "# CUDA attention kernels: machine code (bench/gpu/cuda_sass.py)", "",
        f"{origin}. {_totals(rows, results)}. {seconds:.0f} s.", "",
        "Static instruction counts (each instruction once; loops not unrolled) from `cuobjdump -sass`; registers, "
        "stack and static shared memory from `cuobjdump --dump-resource-usage` (sm_90's ELF counts the 1 KiB "
        "reserved per block as static shared memory); spilled bytes from ptxas -v ('?': no log). The criteria "
        "are bench/gpu/cuda_sass_criteria.py; 'gap' marks a known gap of issue 43, not a pass.", "",
        "## Failures", "", *(failures or ["none"]), "",
        "## Known gaps (issue 43)", "", *(gap_lines(results) or ["none"]), "",
        "## Per kernel, dtype and target (ranges over the instantiations)", "", *grouped(rows), "",
        "## Every instantiation", "", *table(rows, results), ""])


def summary(rows: list[SassRow], results: list[Finding], origin: str, seconds: float, full: bool = False) -> str:
    failures = failure_lines(results)
    body = table(rows, results) if full else grouped(rows)
    return "\n".join([f"== CUDA machine code: {origin}; {seconds:.0f} s", *body, "known gaps:",
                      *(gap_lines(results) or ["  none"]), _totals(rows, results),
                      *(["FAILED (regressions, or known gaps that now hold):", *failures] if failures else ["OK"])])
