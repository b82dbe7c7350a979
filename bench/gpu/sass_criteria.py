"""What each attention kernel's machine code must contain (issue 43), the known gaps, and the check.

API (stable; the Triton report ``triton_aot.py`` and the CUDA report ``cuda_sass.py`` both use it):

- :class:`Requirement` ``(kernel_pattern, target, count, op, value, note, config_pattern="")``: on
  every compile of a kernel whose name ``re.fullmatch``-es ``kernel_pattern``, for a target that
  ``re.fullmatch``-es ``target``, whose config ``re.search``-es ``config_pattern`` (``""``: any),
  ``<count> <op> <value>`` holds. ``count`` names an opcode count
  (:data:`sass_opcodes.COUNTS`: ``HGMMA``, ``LDL``, ...) or a resource (``stack``, ``regs``, ...);
  ``op`` is one of ``> >= == <= <``. Its :attr:`~Requirement.name` is ``"<count> <op> <value>"``,
  e.g. ``"HGMMA > 0"``.
- :class:`KnownGap` ``(kernel_pattern, target, requirement_name, config_pattern, why)``: that
  requirement is known to fail today for the compiles whose config ``re.search``-es
  ``config_pattern`` (``""``: every config), and why (the item of issue 43 that fixes it).
- :class:`SassRow` ``(kernel, target, config, counts, resources)``: one compile's findings.
- :func:`evaluate` ``(kernel, target, config, counts, resources, requirements, gaps) -> list[Finding]``:
  one :class:`Finding` per requirement that applies to that compile, with its status (below).
  :data:`TRITON_KERNELS` matches the kernels that :data:`REQUIREMENTS` judges.
- :func:`findings` ``(rows, requirements, gaps, judge_gaps=True) -> list[Finding]``: every finding of
  ``rows``, plus the findings about the gaps themselves (``judge_gaps=False``: not those, for a run over
  part of a scope); :func:`check` ``(rows, requirements, gaps, judge_gaps=True) -> list[Finding]``: only
  the failures. ``requirements``/``gaps`` default to this module's :data:`REQUIREMENTS` and
  :data:`KNOWN_GAPS` (the Triton attention kernels); a caller with other kernels passes its own.

Statuses: ``pass``; ``gap (issue 43)`` (fails, inside a known gap: reported, never a pass, not a
failure); and the failures:

- ``REGRESSION``: fails outside every known gap;
- ``MISSING``: the row has no such count or resource;
- ``UNCHECKED``: no requirement names the row's kernel and target, whatever its config (a kernel nobody
  encoded would otherwise pass silently; a row of a named kernel and target outside every requirement's
  ``config_pattern`` is simply not judged);
- ``GAP CLOSED``: a known gap holds in every row it matches, or matches none of the rows its requirement
  judges for its kernels and targets (its configs were pruned): remove the gap, like a strict xfail. A gap
  whose kernels and targets have no row its requirement judges (a run over fewer targets) is not judged;
- ``GAP UNKNOWN``: a gap names no requirement of its kernels and targets (a typo would otherwise excuse
  nothing and be noticed by no one).
"""
from __future__ import annotations

import functools
import operator
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

__all__ = ["FAILURES", "GAP", "GAP_CLOSED", "GAP_UNKNOWN", "KNOWN_GAPS", "MISSING", "PASS", "REGRESSION",
           "REQUIREMENTS", "TRITON_KERNELS", "UNCHECKED", "Finding", "KnownGap", "Requirement",
           "SassRow", "check", "evaluate", "findings"]

_OPS = {">": operator.gt, ">=": operator.ge, "==": operator.eq, "<=": operator.le, "<": operator.lt}

PASS, GAP = "pass", "gap (issue 43)"
REGRESSION, MISSING, UNCHECKED, GAP_CLOSED, GAP_UNKNOWN = (
    "REGRESSION", "MISSING", "UNCHECKED", "GAP CLOSED", "GAP UNKNOWN")
#: The statuses that fail the check.
FAILURES = frozenset({REGRESSION, MISSING, UNCHECKED, GAP_CLOSED, GAP_UNKNOWN})


@dataclass(frozen=True)
class Requirement:
    kernel_pattern: str
    target: str
    count: str
    op: str
    value: int
    note: str = ""
    config_pattern: str = ""

    def __post_init__(self):
        if self.op not in _OPS:
            raise ValueError(f"op must be one of {' '.join(_OPS)}, got {self.op!r}")

    @property
    def name(self) -> str:
        return f"{self.count} {self.op} {self.value}"

    def names(self, kernel: str, target: str) -> bool:
        """Whether this requirement is about ``kernel`` on ``target`` (in some configs at least)."""
        return bool(re.fullmatch(self.kernel_pattern, kernel) and re.fullmatch(self.target, target))

    def applies(self, kernel: str, target: str, config: str) -> bool:
        return self.names(kernel, target) and bool(re.search(self.config_pattern, config))

    def holds(self, actual: int) -> bool:
        return _OPS[self.op](actual, self.value)


@dataclass(frozen=True)
class KnownGap:
    kernel_pattern: str
    target: str
    requirement_name: str
    config_pattern: str
    why: str

    def covers(self, kernel: str, target: str, config: str, requirement: Requirement) -> bool:
        return (requirement.name == self.requirement_name and bool(re.fullmatch(self.kernel_pattern, kernel))
                and bool(re.fullmatch(self.target, target)) and bool(re.search(self.config_pattern, config)))


@dataclass(frozen=True)
class SassRow:
    kernel: str
    target: str
    # What tells this compile from the kernel's others, e.g. "bf16 D=128 causal BLOCK_M=128 BLOCK_N=64 w8 s2";
    # the Triton rows open with the dtype and head dims, which the Triton requirements' config_pattern reads.
    config: str
    counts: Mapping[str, int]  # sass_opcodes.opcode_counts
    resources: Mapping[str, int] = field(default_factory=dict)  # regs, stack, shared, ...


@dataclass(frozen=True)
class Finding:
    kernel: str
    target: str
    config: str
    requirement: str  # Requirement.name ("" for UNCHECKED)
    status: str
    actual: int | None = None
    why: str = ""  # the gap's reason, or what went wrong

    @property
    def failed(self) -> bool:
        return self.status in FAILURES

    def __str__(self) -> str:
        value = "" if self.actual is None else f" (is {self.actual})"
        why = f": {self.why}" if self.why else ""
        return f"{self.status}: {self.kernel} {self.target} {self.config}: {self.requirement}{value}{why}"


# The criteria for the Triton attention kernels (attn_ext/ops/attention/triton_*.py). Targets are
# Triton's names: "sm_90" compiles for sm_90a (Triton's cc 90 target has the wgmma/TMA/setmaxnreg features).
_TRITON_MMA = r"_fwd_kernel|_bwd_dkdv|_bwd_dq"
_TRITON_OTHER = r"_bwd_preprocess|_merge_fwd_kernel|_merge_bwd_kernel"  # no tl.dot: only the spill criteria
# The Hopper forward and backward through TMA descriptors (triton_fwd_tma.py, triton_bwd_tma.py, opt-in): compiled
# for sm_90 only, where their dispatch takes them; their spill gaps, as the general kernels', come from the table.
_TRITON_TMA = r"_fwd_tma_kernel|_bwd_dkdv_tma_kernel|_bwd_dq_tma_kernel"
#: The Triton kernels that REQUIREMENTS judges (triton_aot.py checks the rows of these only).
TRITON_KERNELS = f"{_TRITON_MMA}|{_TRITON_OTHER}|{_TRITON_TMA}"
# The scope: the 16-bit types at D = 64 and 128 (Dv for the merge kernels). fp32 has no tensor-core
# path (exact fp32 dots: FFMA), and the other head dims are compiled and reported but not judged.
_SCOPE = r"^(fp16|bf16) Dv?=(64|128)\b"
# The TMA forward's warp-specialised configs: 4 warps without the causal rule (8 warps silently ignore the request,
# and the causal loop does not ask), e.g. "bf16 D=128 N=256 BLOCK_M=128 BLOCK_N=64 w4 s2".
_TMA_WARP_SPECIALISED = r"^(fp16|bf16) D=(64|128) (N=\d+ )?BLOCK_M=\d+ BLOCK_N=\d+ w4 "


#: The word a compile of a guarded code path carries in its config (triton_aot_sass._config): the attention
#: kernels' variant for non-finite rows (GUARD_ROWS), run only for calls whose Q, K or V holds a NaN or inf (the
#: forward's fix-up launch, one fixed 16 x 16 tile; the backward's guarded kernels). Its exact per-pair product
#: costs registers the common path does not spend, and the autotuner never weighs it against the common path's
#: configs, so "no spill" does not judge it; the MMA criteria do.
GUARDED = " guarded "
_SCOPE_COMMON_PATH = _SCOPE + rf"(?!.*{GUARDED})"


def _no_spill(kernels: str, target: str) -> tuple[Requirement, ...]:
    return (Requirement(kernels, target, "LDL", "==", 0, "no local loads (spills read back)", _SCOPE_COMMON_PATH),
            Requirement(kernels, target, "STL", "==", 0, "no local stores (spills)", _SCOPE_COMMON_PATH),
            Requirement(kernels, target, "stack", "==", 0, "no stack frame (local memory per thread)",
                        _SCOPE_COMMON_PATH))


REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement(_TRITON_MMA, r"sm_90a?", "HGMMA", ">", 0, "Hopper warpgroup MMA (wgmma)", _SCOPE),
    Requirement(_TRITON_MMA, r"sm_90a?", "UTMALDG", ">", 0, "K/V (and Q, dO) loaded by TMA descriptors", _SCOPE),
    *_no_spill(_TRITON_MMA, r"sm_90a?"),
    Requirement(_TRITON_MMA, r"sm_80", "HMMA.16816", ">", 0, "FlashAttention-2's m16n8k16 mma.sync", _SCOPE),
    Requirement(_TRITON_MMA, r"sm_80", "LDSM", ">", 0, "ldmatrix: MMA fragments from shared memory", _SCOPE),
    Requirement(_TRITON_MMA, r"sm_80", "LDGSTS", ">", 0, "cp.async pipeline of global loads", _SCOPE),
    *_no_spill(_TRITON_MMA, r"sm_80"),
    *_no_spill(_TRITON_OTHER, r"sm_80|sm_90a?"),
    Requirement(_TRITON_TMA, r"sm_90a?", "HGMMA", ">", 0, "Hopper warpgroup MMA (wgmma)", _SCOPE),
    Requirement(_TRITON_TMA, r"sm_90a?", "UTMALDG", ">", 0, "Q, K, V loaded by TMA descriptors", _SCOPE),
    Requirement(r"_fwd_tma_kernel", r"sm_90a?", "SETMAXREG", ">", 0,
                "warp specialisation (producer/consumer register split)", _TMA_WARP_SPECIALISED),
    *_no_spill(_TRITON_TMA, r"sm_90a?"),
)

# Known gaps: what fails today, each to be removed by the item of issue 43 that closes it (the check fails once
# a gap holds in every compile it matches, or matches none). Measured with Triton 3.9 over every kept config
# (make sass-report, 794 compiles); a failure outside them is a regression.
_ITEM2 = "issue 43 item 2"
_SM90 = r"sm_90a?"


#: The code paths of the AOT cases, as their configs name them after the head dims ("bf16 D=128 causal BLOCK_M=...").
_VARIANT_WORDS = {("plain",): "", ("causal",): " causal", ("pairs",): " mask", ("causal_pairs",): " causal dropout"}


def _spill_gaps() -> tuple[KnownGap, ...]:
    """LDL, STL and stack where the autotuner may still pick a config that spills: the kernels, targets, head dims
    and code paths in which the running Triton's AOT table (attn_ext/ops/attention/spill_tables/, written by
    spill_table.py) has no full-rate spill-free tile, so the pruning (triton_spills.py) keeps the spilling
    ones. Elsewhere the pruning drops every config that spills, and a spill in a kept one is a regression."""
    from attn_ext.ops.attention.triton_spills import spill_gaps

    gaps = []
    for kernel, arch, d, _, variants, why in spill_gaps():
        config = rf"^(fp16|bf16) D={d}{_VARIANT_WORDS[variants]} (N=\d+ )?BLOCK_"
        target = _SM90 if arch == 90 else "sm_80"
        gaps += [KnownGap(re.escape(kernel), target, f"{count} == 0", config,
                          f"{_ITEM2}: no spill-free full-rate tile ({why})") for count in ("LDL", "STL", "stack")]
    return tuple(gaps)


_STATIC_GAPS: tuple[KnownGap, ...] = (
    # The general kernels (key padding, masks, dropout, fp32) load by cp.async (LDGSTS) or LDG; the common path's
    # TMA kernels (_TRITON_TMA, opt-in) load through tensor descriptors.
    KnownGap(_TRITON_MMA, _SM90, "UTMALDG > 0", "",
             f"{_ITEM2}: the general kernels load by cp.async; TMA is the common path's kernels' (opt-in)"),
    # wgmma takes 64 rows per warpgroup: a 16- or 32-row tile of the MMA's row dimension (the queries' BLOCK_M;
    # dK/dV's key tile BLOCK_N) compiles to mma.sync (HMMA) instead. Prune those tiles on sm_90 or accept them.
    KnownGap(r"_fwd_kernel|_bwd_dq", _SM90, "HGMMA > 0", r"BLOCK_M=(16|32) ", f"{_ITEM2}: tiles under 64 rows"),
    KnownGap(r"_bwd_dkdv", _SM90, "HGMMA > 0", r"BLOCK_N=(16|32) ", f"{_ITEM2}: key tiles under 64 rows"),
)


@functools.lru_cache(maxsize=None)
def triton_known_gaps() -> tuple[KnownGap, ...]:
    """The Triton attention kernels' known gaps: the static ones and the spill gaps the AOT table implies (read
    on first use: the table is part of attn_ext, which imports torch, and the CUDA check runs without it)."""
    return _STATIC_GAPS + _spill_gaps()


def __getattr__(name: str):
    if name == "KNOWN_GAPS":  # computed on first access, see triton_known_gaps
        return triton_known_gaps()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

def evaluate(kernel: str, target: str, config: str, counts: Mapping[str, int], resources: Mapping[str, int],
             requirements: Iterable[Requirement] = REQUIREMENTS,
             gaps: Iterable[KnownGap] | None = None) -> list[Finding]:
    """One finding per requirement that applies to this compile (none: one ``UNCHECKED`` finding)."""
    gaps = triton_known_gaps() if gaps is None else tuple(gaps)
    out = []
    named = False
    for req in requirements:
        named = named or req.names(kernel, target)
        if not req.applies(kernel, target, config):
            continue
        actual = counts.get(req.count, resources.get(req.count))
        if actual is None:
            out.append(Finding(kernel, target, config, req.name, MISSING, None,
                               f"no count or resource {req.count!r} in this row"))
            continue
        if req.holds(actual):
            out.append(Finding(kernel, target, config, req.name, PASS, actual))
            continue
        gap = next((g for g in gaps if g.covers(kernel, target, config, req)), None)
        out.append(Finding(kernel, target, config, req.name, GAP if gap else REGRESSION, actual,
                           gap.why if gap else req.note))
    if not named:
        out.append(Finding(kernel, target, config, "", UNCHECKED, None,
                           "no requirement applies to this kernel and target; encode one"))
    return out


def _gap_findings(rows: list[SassRow], requirements: tuple[Requirement, ...],
                  gaps: tuple[KnownGap, ...]) -> list[Finding]:
    """``GAP CLOSED`` for each gap that holds in every row it matches, or matches no row where its
    requirement is judged for its kernels and targets; ``GAP UNKNOWN`` for each gap whose requirement name
    no requirement of its kernels and targets has."""
    out = []
    for gap in gaps:
        label = f"gap {gap.kernel_pattern!r} {gap.config_pattern!r}"
        mine = [row for row in rows if re.fullmatch(gap.kernel_pattern, row.kernel)
                and re.fullmatch(gap.target, row.target)]
        named = [r for r in requirements if r.name == gap.requirement_name]
        judged = [(row, r) for row in mine for r in named if r.applies(row.kernel, row.target, row.config)]
        matched = [(row, r) for row, r in judged if gap.covers(row.kernel, row.target, row.config, r)]
        failing = [(row, r) for row, r in matched
                   if not r.holds(row.counts.get(r.count, row.resources.get(r.count, -1)))]
        if matched and not failing:
            out.append(Finding(label, gap.target, gap.config_pattern, gap.requirement_name, GAP_CLOSED, None,
                               f"holds in all {len(matched)} compiles this gap matches: remove it from the known gaps"))
        elif judged and not matched:
            out.append(Finding(label, gap.target, gap.config_pattern, gap.requirement_name, GAP_CLOSED, None,
                               f"matches none of the {len(judged)} compiles its requirement judges for its kernels "
                               "(their configs changed or were pruned): remove it from the known gaps"))
        if mine and not any(r.names(row.kernel, row.target) for row in mine for r in named):
            out.append(Finding(label, gap.target, gap.config_pattern, gap.requirement_name, GAP_UNKNOWN, None,
                               "no requirement of that name applies to the kernels it matches"))
    return out


def findings(rows: Iterable[SassRow], requirements: Iterable[Requirement] = REQUIREMENTS,
             gaps: Iterable[KnownGap] | None = None, judge_gaps: bool = True) -> list[Finding]:
    """Every finding of ``rows`` (passes, gaps and failures), then those about the gaps themselves
    (``judge_gaps=False``: not those, for rows that are a subset of a scope, where a gap may seem closed only
    because its failing compiles were left out)."""
    rows, requirements = list(rows), tuple(requirements)
    gaps = triton_known_gaps() if gaps is None else tuple(gaps)
    out = [f for row in rows
           for f in evaluate(row.kernel, row.target, row.config, row.counts, row.resources, requirements, gaps)]
    return out + (_gap_findings(rows, requirements, gaps) if judge_gaps else [])


def check(rows: Iterable[SassRow], requirements: Iterable[Requirement] = REQUIREMENTS,
          gaps: Iterable[KnownGap] | None = None, judge_gaps: bool = True) -> list[Finding]:
    """The failures among :func:`findings`: empty when the machine code meets every criterion outside
    the known gaps and every known gap still fails somewhere."""
    return [f for f in findings(rows, requirements, gaps, judge_gaps) if f.failed]
