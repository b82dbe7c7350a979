"""The machine-code check of the Triton AOT compiles: every compile of an attention kernel judged by the
criteria of issue 43 (:mod:`sass_criteria`), and the per-kernel table of the machine-code report.

A compile's config, as the criteria read it, opens with its dtype and head dims, then its tiles, e.g.
``bf16 D=128 causal BLOCK_M=128 BLOCK_N=64 w8 s2`` (``causal``/``mask``: the attention op's variants,
which add dropout; none: the cross-attention op).
"""
from __future__ import annotations

import re
from collections import Counter

from sass_criteria import FAILURES, GAP, GAP_CLOSED, GAP_UNKNOWN, PASS, TRITON_KERNELS, Finding, SassRow, findings
from sass_opcodes import COUNTS

__all__ = ["ci_cover", "group_table", "judge", "report_lines", "sass_rows"]

# Worst first: the status a group of compiles shows is that of its worst finding.
_RANK = {**{status: 0 for status in FAILURES}, GAP: 1, PASS: 2}


def _config(row) -> str:
    # A launch of a guarded code path (GUARD_ROWS: the attention kernels' path for non-finite rows) says so: the
    # criteria hold it to the MMA mix but not to "no spill" (sass_criteria.GUARDED).
    guarded = " guarded" if dict(row.job.options).get("GUARD_ROWS") else ""
    return f"{row.dtypes()} {row.dims()}{guarded} {row.job.config()}"


def sass_rows(rows: list) -> list[SassRow]:
    """The :class:`sass_criteria.SassRow` of each compiled Triton attention kernel among ``rows``
    (:class:`triton_aot_report.Row`); failed compiles are the AOT check's own failures."""
    return [SassRow(row.job.kernel, row.job.target, _config(row), row.counts,
                    {key: row.result[key] for key in ("regs", "stack", "local", "shared")})
            for row in rows if "error" not in row.result and re.fullmatch(TRITON_KERNELS, row.job.kernel)]


def judge(rows: list, judge_gaps: bool = True) -> list[Finding]:
    """Every finding of the attention kernels among ``rows``; ``judge_gaps=False`` on a run over a subset
    of the cases or kernels, where a known gap may hold only because its failing compiles were left out."""
    return findings(sass_rows(rows), judge_gaps=judge_gaps)


def _size(row) -> tuple:
    """What makes a config large: its tile area, then its warps and stages."""
    options = dict(row.job.options)
    return row.job.tile_area(), options.get("num_warps", 4), options.get("num_stages", 3)


def group_table(rows: list, found: list[Finding]) -> str:
    """Markdown: one line per kernel, target, dtype and dims: how many kept configs compiled, how many
    spill none, the largest config's resources and counts, the largest spill-free config, and the worst
    status of the group's findings."""
    status: dict[tuple, str] = {}
    for f in found:
        key = (f.kernel, f.target, f.config)
        if key not in status or _RANK.get(f.status, 0) < _RANK.get(status[key], 0):
            status[key] = f.status
    groups: dict[tuple, list] = {}
    for row in rows:
        if "error" not in row.result and re.fullmatch(TRITON_KERNELS, row.job.kernel):
            groups.setdefault((row.job.kernel, row.job.target, row.dtypes(), row.dims()), []).append(row)
    lines = ["| kernel | target | dtype | dims | configs | spill-free | largest config | regs | stack | smem | "
             + " | ".join(COUNTS) + " | largest spill-free config | status |",
             "|---|---|---|---|--:|--:|---|--:|--:|--:|" + "--:|" * len(COUNTS) + "---|---|"]
    for (kernel, target, dtype, dims), group in sorted(groups.items()):
        largest = max(group, key=_size)
        free = [row for row in group if row.result["stack"] == 0]
        worst = min((status.get((kernel, target, _config(row)), "not judged") for row in group),
                    key=lambda s: _RANK.get(s, 3))
        r = largest.result
        lines.append(f"| {kernel} | {target} | {dtype} | {dims} | {len(group)} | {len(free)} | "
                     f"{largest.job.config()} | {r['regs']} | {r['stack']} | {r['shared']} | "
                     + " | ".join(str(largest.counts.get(name, "-")) for name in COUNTS)
                     + f" | {max(free, key=_size).job.config() if free else 'none'} | {worst} |")
    return "\n".join(lines) + "\n"


def report_lines(found: list[Finding]) -> list[str]:
    """The check's verdict: one line per known gap (its requirements, as LDL, STL and stack go together, and
    how many compiles it excuses), then every failure."""
    gaps: dict[tuple, list[Finding]] = {}
    for f in found:
        if f.status == GAP:
            gaps.setdefault((f.kernel, f.target, f.why), []).append(f)
    judged = {(f.kernel, f.target, f.config) for f in found if f.status not in (GAP_CLOSED, GAP_UNKNOWN)}
    lines = [f"machine-code check: {len(judged)} compiles judged, "
             f"{sum(f.status == PASS for f in found)} criteria met, {sum(f.status == GAP for f in found)} "
             f"in known gaps, {sum(f.failed for f in found)} failures"]
    for (kernel, target, why), group in sorted(gaps.items()):
        example = [f for f in group if f.config == group[0].config]
        lines.append(f"gap (issue 43): {kernel} {target}: {', '.join(dict.fromkeys(f.requirement for f in group))} "
                     f"not met in {len({f.config for f in group})} compiles (e.g. {group[0].config}: "
                     f"{', '.join(f'{f.requirement.split()[0]} {f.actual}' for f in example)}): {why}")
    lines += [f"FAIL: {f}" for f in found if f.failed]
    return lines


def _tiles_and_dims(job, cases) -> tuple:
    return job.kernel, job.target, job.config(), tuple(sorted({re.match(r"\S+", case.dims).group() for case in cases}))


def ci_cover(sass_jobs: dict, ci_jobs: dict) -> list[str]:
    """What CI's scope (``ci_jobs``) compiles of the machine-code report's (``sass_jobs``), so that the report
    says plainly which compiles only ``make sass-report`` judges: per dtype and dims, how many it leaves out,
    and how many of those have the same kernel, target, tiles and head dim compiled by CI in another dtype
    or variant."""
    left = [job for job in sass_jobs if job not in ci_jobs]
    ci_tiles = {_tiles_and_dims(job, cases) for job, cases in ci_jobs.items()}
    per_case = Counter(f"{sass_jobs[job][0].dtype} {sass_jobs[job][0].dims}" for job in left)
    elsewhere = sum(_tiles_and_dims(job, sass_jobs[job]) in ci_tiles for job in left)
    lines = [f"CI's scope compiles {len(sass_jobs) - len(left)} of these {len(sass_jobs)} compiles; of the "
             f"{len(left)} it leaves out, {elsewhere} have their kernel, target, tiles and head dim compiled in CI "
             f"for another dtype or variant, {len(left) - elsewhere} not at all"]
    if left:
        lines.append("left out of CI, judged only by `make sass-report` (dtype dims: compiles): "
                     + ", ".join(f"{case}: {n}" for case, n in sorted(per_case.items())))
    return lines
