"""The machine-code criteria of issue 43 (bench/gpu/sass_criteria.py) on made-up SASS and rows: the counts
read from a ``cuobjdump -sass`` dump, and the check: a regression fails, a known gap is reported as a gap
and passes, a known gap that now holds fails (a strict xfail), and mistakes in the tables fail too."""
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))

from sass_criteria import (GAP, GAP_CLOSED, GAP_UNKNOWN, KNOWN_GAPS, MISSING, PASS, REGRESSION,  # noqa: E402
                           REQUIREMENTS, TRITON_KERNELS, UNCHECKED, KnownGap, Requirement, SassRow, check,
                           evaluate, findings)
from sass_opcodes import COUNTS, opcode_counts, split_functions  # noqa: E402

# Two kernels as cuobjdump prints them (sm_90a lines; predicates, modifiers and a lower-case shape).
DUMP = """
\tcode for sm_90a
\t\tFunction : _bwd_dq
\t.headerflags\t@"EF_CUDA_ACCELERATORS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                        /* 0x00000a00ff017b82 */
        /*0010*/              @!PT LDS RZ, [RZ] ;                                /* 0x00000000fffff984 */
        /*0020*/                   LDG.E.128 R4, desc[UR12][R2.64] ;             /* 0x0000000c02047981 */
        /*0030*/               @P0 LDG.E.U16 R8, desc[UR12][R2.64+0x10] ;        /* 0x0000100c02080981 */
        /*0040*/                   LDGSTS.E.BYPASS.LTC128B.128 [R9], desc[UR12][R2.64] ; /* 0x0 */
        /*0048*/                   LDGSTS.E.BYPASS.LTC128B [R9+0x10], desc[UR12][R2.64+0x10] ; /* 0x0 */
        /*0050*/                   LDSM.16.M88.4 R32, [R62] ;                    /* 0x000000003e20783b */
        /*0060*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ; /* 0x0 */
        /*0070*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24, gsb0 ; /* 0x0 */
        /*0080*/                   STL.64 [R1+0x8], R10 ;                        /* 0x0 */
        /*0090*/                   LDL.64 R10, [R1+0x8] ;                        /* 0x0 */
        /*00a0*/                   LDL R12, [R1+0x10] ;                          /* 0x0 */
        /*00b0*/              @UP0 UTMALDG.2D [UR8], [UR4] ;                     /* 0x0 */
        /*00c0*/                   USETMAXREG.DEALLOC.CTAPOOL 0x28 ;             /* 0x0 */
        /*00d0*/                   EXIT ;                                        /* 0x000000000000794d */
\t\t..........
\t\tFunction : _fwd_kernel
        /*0000*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;         /* 0x0 */
        /*0010*/                   HMMA.1688.F32.TF32 R4, R8, R12, R4 ;          /* 0x0 */
        /*0020*/                   LDG.E.64 R4, [R2.64] ;                        /* 0x0 */
        /*0030*/                   EXIT ;                                        /* 0x0 */
"""


def test_split_functions_and_opcode_counts_read_each_kernel():
    functions = split_functions(DUMP)
    assert list(functions) == ["_bwd_dq", "_fwd_kernel"]
    dq, fwd = opcode_counts(functions["_bwd_dq"]), opcode_counts(functions["_fwd_kernel"])
    assert list(dq) == list(COUNTS)
    assert dq == {"HGMMA": 2, "HMMA": 0, "HMMA.16816": 0, "LDSM": 1, "LDGSTS": 2, "LDGSTS.128": 1, "UTMALDG": 1,
                  "LDG": 2, "LDG.128": 1, "LDL": 2, "STL": 1, "SETMAXREG": 1}
    # HMMA of any shape, HMMA.16816 of that shape only; LTC128B is a cache hint, not a 16-byte LDGSTS; a 16-byte
    # LDGSTS is not a 16-byte LDG; LDS/LDC are not LDG.
    assert (fwd["HMMA"], fwd["HMMA.16816"], fwd["LDG"], fwd["LDG.128"], fwd["HGMMA"]) == (2, 1, 1, 0, 0)


def _counts(**changes):
    return {**dict.fromkeys(COUNTS, 0), **changes}


# Rows that meet every Triton criterion, per target (16-bit types at D = 64: the criteria's scope).
GOOD = {"sm_90": _counts(HGMMA=8, UTMALDG=4, LDG=2), "sm_80": _counts(HMMA=16, **{"HMMA.16816": 16}, LDSM=8, LDGSTS=8)}
NO_SPILL = {"regs": 128, "stack": 0, "local": 0, "shared": 65536}


def _row(kernel="_bwd_dq", target="sm_80", config="bf16 D=64 BLOCK_M=64 BLOCK_N=64 w4 s2", resources=NO_SPILL,
         **changes):
    return SassRow(kernel, target, config, _counts(**{**GOOD[target], **changes}), dict(resources))


def _statuses(found):
    return {(f.kernel, f.requirement): f.status for f in found}


def test_a_kernel_that_meets_every_criterion_passes():
    found = evaluate("_bwd_dq", "sm_80", "fp16 D=128 BLOCK_M=64", GOOD["sm_80"], NO_SPILL)
    assert {f.requirement for f in found} == {"HMMA.16816 > 0", "LDSM > 0", "LDGSTS > 0", "LDL == 0", "STL == 0",
                                              "stack == 0"}
    assert all(f.status == PASS for f in found)


def test_a_regression_fails_the_check():
    spilling = _row(LDL=3, STL=2, resources=dict(NO_SPILL, stack=24))
    failures = check([spilling, _row(LDSM=0, kernel="_fwd_kernel")], gaps=())
    assert {(f.kernel, f.requirement, f.status, f.actual) for f in failures} == {
        ("_bwd_dq", "LDL == 0", REGRESSION, 3), ("_bwd_dq", "STL == 0", REGRESSION, 2),
        ("_bwd_dq", "stack == 0", REGRESSION, 24), ("_fwd_kernel", "LDSM > 0", REGRESSION, 0)}
    assert "REGRESSION: _bwd_dq sm_80" in str(failures[0])


def test_a_known_gap_is_reported_as_a_gap_and_passes_the_check():
    gap = KnownGap("_bwd_dq", "sm_90", "UTMALDG > 0", "", "issue 43 item 2")
    rows = [_row(target="sm_90", UTMALDG=0), _row(target="sm_90", config="fp16 D=128 BLOCK_M=16", UTMALDG=0)]
    found = findings(rows, gaps=(gap,))
    assert [f.status for f in found if f.requirement == "UTMALDG > 0"] == [GAP, GAP]
    assert all(f.status == PASS for f in found if f.requirement != "UTMALDG > 0")
    assert check(rows, gaps=(gap,)) == []
    # The same failure in a kernel the gap does not name is a regression.
    assert [f.status for f in check([_row(kernel="_fwd_kernel", target="sm_90", UTMALDG=0)], gaps=(gap,))] \
        == [REGRESSION]


def test_a_known_gap_that_now_holds_fails_the_check():
    gap = KnownGap("_bwd_dq", "sm_90", "stack == 0", r"BLOCK_M=128", "issue 43 item 2")
    big = "bf16 D=128 BLOCK_M=128 BLOCK_N=64 w8 s2"
    spilling, fixed = dict(NO_SPILL, stack=300), NO_SPILL
    # Still spilling in one of the configs it matches: open, no failure.
    assert check([_row(target="sm_90", config=big, resources=spilling),
                  _row(target="sm_90", config=big.replace("bf16", "fp16"))], gaps=(gap,)) == []
    # Spill-free in every config it matches: closed, which fails until the gap is removed.
    failures = check([_row(target="sm_90", config=big, resources=fixed)], gaps=(gap,))
    assert [(f.status, f.requirement) for f in failures] == [(GAP_CLOSED, "stack == 0")]
    assert "remove it" in failures[0].why
    # A spill outside the gap's configs is a regression, not excused by it; and a gap that matches none of
    # the compiles its requirement judges (its configs pruned) is stale: closed too.
    failures = check([_row(target="sm_90", resources=spilling)], gaps=(gap,))
    assert [f.status for f in failures] == [REGRESSION, GAP_CLOSED] and "matches none" in failures[1].why
    # Not judged on a subset, nor on a run without its kernel and target.
    assert check([_row(target="sm_90", config=big, resources=fixed)], gaps=(gap,), judge_gaps=False) == []
    assert check([_row(target="sm_80", config=big)], gaps=(gap,)) == []


def test_mistakes_in_the_tables_or_rows_fail():
    typo = KnownGap("_bwd_dq", "sm_90", "UTMALDG>0", "", "a name no requirement has")
    assert GAP_UNKNOWN in {f.status for f in check([_row(target="sm_90")], gaps=(typo,))}
    missing = SassRow("_bwd_dq", "sm_80", "fp16 D=64", {"HMMA.16816": 4}, {})
    assert {f.requirement for f in check([missing], gaps=()) if f.status == MISSING} == {
        "LDSM > 0", "LDGSTS > 0", "LDL == 0", "STL == 0", "stack == 0"}
    # A kernel no requirement names would pass silently: it fails instead.
    assert [f.status for f in check([_row(kernel="_renamed_fwd")], gaps=())] == [UNCHECKED]
    with pytest.raises(ValueError, match="op"):
        Requirement("k", "sm_80", "LDL", "=", 0)


def test_the_triton_criteria_judge_the_issues_dtypes_and_head_dims_only():
    fp32 = _row(config="fp32 D=64 BLOCK_M=64", **{"HMMA.16816": 0})  # exact fp32 dots: no tensor cores
    d256 = _row(config="bf16 D=256 BLOCK_M=64", LDSM=0)
    assert evaluate(fp32.kernel, fp32.target, fp32.config, fp32.counts, fp32.resources) == []
    assert evaluate(d256.kernel, d256.target, d256.config, d256.counts, d256.resources) == []
    merge = _row(kernel="_merge_fwd_kernel", config="fp16 Dv=128 BLOCK_R=32", resources=dict(NO_SPILL, stack=8))
    assert _statuses(check([merge]))[("_merge_fwd_kernel", "stack == 0")] == REGRESSION


def test_a_spill_is_a_regression_unless_the_spill_table_has_no_spill_free_full_rate_tile(monkeypatch):
    """The rule on a table where causal dK/dV at D = 128 on sm_90 has spill-free tiles only below full rate (as
    Triton 3.9's had before 2026-11-29; the committed tables may have no such code path at all)."""
    import sass_criteria
    from attn_ext.ops.attention import triton_spills

    table = dict(triton_spills.spill_table())
    table[("_bwd_dkdv", 90, 2, 128, 128, "causal")] = {(16, 16, 2, 1): 0, (32, 128, 8, 2): 16, (64, 64, 8, 2): 64}
    monkeypatch.setattr(triton_spills, "spill_table", lambda version=None: table)
    sass_criteria.triton_known_gaps.cache_clear()
    try:
        gaps = {(k, a, d, v) for k, a, d, _, v, _ in triton_spills.spill_gaps()}

        def status(kernel, config, target="sm_90"):
            row = _row(kernel, target, config, dict(NO_SPILL, stack=16), LDL=2, STL=2)
            return _statuses(findings([row], judge_gaps=False))[kernel, "stack == 0"]

        # The plain forward at D = 128 has spill-free full-rate tiles, which the pruning keeps alone: a spill is a
        # regression in every config.
        assert ("_fwd_kernel", 90, 128, ("plain",)) not in gaps
        assert status("_fwd_kernel", "bf16 D=128 BLOCK_M=128 BLOCK_N=64 w8 s2") == REGRESSION
        assert status("_fwd_kernel", "bf16 D=128 BLOCK_M=16 BLOCK_N=16 w2 s1") == REGRESSION
        # Causal dK/dV at D = 128 has none: the pruning keeps the spilling tiles there, a known gap ...
        assert ("_bwd_dkdv", 90, 128, ("causal",)) in gaps
        assert status("_bwd_dkdv", "fp16 D=128 causal BLOCK_M=64 BLOCK_N=64 w8 s2") == GAP
        # ... of that code path, head dim and target only.
        assert status("_bwd_dkdv", "fp16 D=128 BLOCK_M=64 BLOCK_N=64 w8 s2") == REGRESSION
        assert status("_bwd_dkdv", "fp16 D=128 causal BLOCK_M=64 BLOCK_N=64 w8 s2", "sm_80") == (
            GAP if ("_bwd_dkdv", 80, 128, ("causal",)) in gaps else REGRESSION)
        assert ("_bwd_dkdv", 90, 64, ("plain",)) not in gaps
        assert status("_bwd_dkdv", "fp16 D=64 BLOCK_M=64 BLOCK_N=64 w8 s2") == REGRESSION
    finally:
        sass_criteria.triton_known_gaps.cache_clear()


def test_every_known_gap_closes_when_its_kernels_meet_the_criteria():
    # Kernels that meet every criterion: no failure but one GAP CLOSED per known gap, so each gap names a
    # requirement that exists and can be closed by the work it cites.
    # The TMA forward has no gap and needs its own counts (below); the TMA backward runs on sm_90 only.
    kernels = [k for k in TRITON_KERNELS.split("|") if k != "_fwd_tma_kernel"]
    tiles = ("BLOCK_M=16 BLOCK_N=16 w2 s1", "BLOCK_M=32 BLOCK_N=32 w4 s2", "BLOCK_M=64 BLOCK_N=16 w4 s2",
             "BLOCK_M=128 BLOCK_N=64 w8 s2")
    code_paths = ("", " causal", " mask", " causal dropout")
    rows = [_row(kernel=k, target=t, config=f"{dtype} D={d}{path} {config}")
            for k in kernels for t in (("sm_90",) if "_tma_" in k else ("sm_80", "sm_90"))
            for dtype in ("fp16", "bf16") for d in (64, 128) for path in code_paths for config in tiles]
    failures = check(rows)
    assert [f.status for f in failures] == [GAP_CLOSED] * len(KNOWN_GAPS)
    assert all("issue 43 item" in gap.why for gap in KNOWN_GAPS)


def test_every_criterion_names_a_kernel_of_the_package():
    # A renamed kernel would leave its criteria judging nothing: each name must be a Triton kernel's.
    sources = "".join(p.read_text() for p in (ROOT / "attn_ext" / "ops" / "attention").glob("triton_*.py"))
    for requirement in REQUIREMENTS:
        for name in requirement.kernel_pattern.split("|"):
            assert re.search(rf"^def {re.escape(name)}\(", sources, re.M), name


def test_the_tma_forward_must_load_by_tma_and_warp_specialise_its_4_warp_configs_without_the_causal_rule():
    kernel, good = "_fwd_tma_kernel", dict(HGMMA=24, UTMALDG=4, SETMAXREG=8)

    def statuses(config, **changes):
        return _statuses(check([_row(kernel, "sm_90", config, **{**good, **changes})]))

    plain, whole, causal = ("bf16 D=128 BLOCK_M=128 BLOCK_N=64 w4 s2", "fp16 D=64 N=256 BLOCK_M=64 BLOCK_N=64 w4 s3",
                            "bf16 D=128 causal BLOCK_M=128 BLOCK_N=64 w8 s2")
    assert all(statuses(config) == {} for config in (plain, whole, causal))  # no failure, no known gap
    passed = findings([_row(kernel, "sm_90", plain, **good)])
    assert {f.requirement for f in passed} == {"HGMMA > 0", "UTMALDG > 0", "SETMAXREG > 0", "LDL == 0",
                                               "STL == 0", "stack == 0"} and all(f.status == PASS for f in passed)
    for config in (plain, whole):  # warp specialisation lost: a regression, not a gap
        assert statuses(config, SETMAXREG=0) == {(kernel, "SETMAXREG > 0"): REGRESSION}
    # Not asked of the causal loop, nor of 8 warps (Triton ignores the request there).
    assert statuses(causal, SETMAXREG=0) == {}
    assert statuses(plain.replace("w4", "w8"), SETMAXREG=0) == {}
    assert statuses(causal, UTMALDG=0) == {(kernel, "UTMALDG > 0"): REGRESSION}
    assert statuses(causal, LDL=1) == {(kernel, "LDL == 0"): REGRESSION}
    # It is compiled for sm_90 only: a row for another target is one nobody encoded.
    assert [f.status for f in check([_row(kernel, "sm_80", plain)])] == [UNCHECKED]


def test_a_guarded_launch_is_held_to_the_mma_mix_but_not_to_no_spill():
    """The guarded code path (the kernels' variant for non-finite rows) may spill; a common-path launch of the
    same tiles may not."""
    from sass_criteria import REGRESSION, SassRow, findings

    counts = {"HGMMA": 0, "HMMA.16816": 4, "LDSM": 2, "LDGSTS": 0, "UTMALDG": 0, "LDL": 6, "STL": 6}
    resources = {"regs": 255, "stack": 16, "local": 16, "shared": 0}
    label = "BLOCK_D=128 BLOCK_DV=128 BLOCK_M=16 BLOCK_N=16 w4 s1"
    guarded = SassRow("_fwd_kernel", "sm_80", f"bf16 D=128 causal guarded {label}", counts, resources)
    common = SassRow("_fwd_kernel", "sm_80", f"bf16 D=128 causal {label}", counts, resources)
    spill_names = ("LDL == 0", "STL == 0", "stack == 0")
    assert not [f for f in findings([guarded], judge_gaps=False)
                if f.status == REGRESSION and f.requirement in spill_names]
    assert {f.requirement for f in findings([common], judge_gaps=False) if f.status == REGRESSION} >= set(spill_names)
