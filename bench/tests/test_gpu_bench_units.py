"""The parts of ``make gpu-check`` that need no GPU: the benchmark modules import, their FLOP counts and
grids, the check before timing, the build check's parsing of ``cuobjdump``, and the report."""
from __future__ import annotations

import math

import pytest
import torch

from bench.gpu import attention, build_check, checks, features, other_ops, plan, report, states, tree


def test_attention_flops_follow_the_cpu_benchmark_convention():
    # Forward: QKᵀ and PV, 2 flops per multiply-add each: 4·B·H·M·N·D.
    assert attention.attention_flops(8, 16, 1024, 1024, 64, "fwd") == 4 * 8 * 16 * 1024 * 1024 * 64
    # Backward: recomputed QKᵀ, dO Vᵀ, Pᵀ dO, dS K, dSᵀ Q: five more products, 3.5x the forward in all.
    fwd_bwd = attention.attention_flops(8, 16, 16384, 16384, 128, "fwd+bwd")
    assert fwd_bwd == 14 * 8 * 16 * 16384**2 * 128
    assert fwd_bwd / attention.attention_flops(8, 16, 16384, 16384, 128, "fwd") == 3.5
    assert attention.tflops(4 * 10**12, 1000.0) == pytest.approx(4.0)
    assert attention.tflops(10**12, None) is None


def test_benchmark_grids_are_the_ones_documented():
    grid = attention.cases()
    assert {(c.dtype, c.d, c.n, c.causal) for c in grid} == {
        (dt, d, n, causal) for dt in ("fp16", "bf16") for d in (64, 128) for n in (1024, 4096, 16384)
        for causal in (False, True)}
    assert (attention.B, attention.H) == (8, 16)
    assert attention.IMPLS == ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex", "cuda", "triton", "triton-tma")
    assert attention.attention_flops(8, 16, 4096, 4096, 64, "fwd", causal=True) * 2 == \
        attention.attention_flops(8, 16, 4096, 4096, 64, "fwd")
    # The state and tree sections take the CPU benchmarks' problems.
    assert [c.n for c in states.cases() if c.kind == "update" and c.backend == "cuda"] == [10**3, 10**4, 10**5, 10**6]
    assert [c.n for c in tree.cases()] == [10**3, 10**4, 10**5, 10**6]
    assert {c.what for c in other_ops.cases()} == {"intention", "sigma_intention", "sdpa", "cholesky"}
    # The features section: each kind on both backends, each with a prediction written before any run.
    assert {(c.kind, c.backend) for c in features.cases()} == set(features.PREDICTED)
    assert {c.kind for c in features.cases() if c.backend == "cuda"} == set(features.KINDS) - {"paged"}
    assert set(features.GOALS) == set(features.KINDS) == set(features.CALLS)
    ids = [p.id for p in plan.plan()]
    assert len(ids) == sum(len(m.cases()) for m in plan.SECTIONS.values()) and len(set(ids)) == len(ids)


def test_check_before_timing_catches_wrong_results():
    ref = torch.randn(4, 64, dtype=torch.float64)
    assert checks.relative_error(ref.float(), ref) < 1e-7
    assert checks.relative_error(torch.zeros_like(ref), ref) == pytest.approx(1.0)
    bad = ref.clone()
    bad[0, 0] = math.nan
    assert checks.relative_error(bad, ref) == math.inf
    # The lse of an empty row is -inf in both: equal, and kept out of the norm.
    lse = torch.tensor([1.0, -math.inf])
    assert checks.relative_error(lse, lse) == 0.0
    assert checks.relative_error(torch.tensor([1.0, 0.0]), lse) == math.inf
    assert checks.relative_error(ref[:2], ref) == math.inf
    with pytest.raises(checks.WrongResult, match=r"out 1\.00e\+00 exceeds 1e-02"):
        checks.require_close("case", {"out": (torch.zeros_like(ref), ref)}, 1e-2)
    noisy = ref * (1 + 1e-3 * torch.randn_like(ref))
    assert attention.check("x", noisy.half(), ref.half(), "fp16") < attention.TOLERANCE["fp16"]
    with pytest.raises(checks.WrongResult, match="dk"):
        attention.check("x", (ref, -ref, ref), (ref, ref, ref), "bf16")


def test_cuobjdump_listing_decides_whether_the_card_can_run_the_kernels():
    listing = ("ELF file    1: _C.1.sm_80.cubin\nELF file    2: _C.2.sm_90.cubin\n"
               "PTX file    1: _C.1.sm_90.ptx\n")
    found = build_check.images(listing)
    assert found == [("elf", 80), ("elf", 90), ("ptx", 90)]
    assert build_check.runnable_on(found, 9, 0) == "sm_90 cubin"
    assert build_check.runnable_on(found, 8, 6) == "sm_80 cubin"  # same major, higher minor
    assert build_check.runnable_on(found, 10, 0) == "compute_90 PTX"  # the driver compiles the PTX
    assert build_check.runnable_on(found, 7, 5) is None
    assert build_check.runnable_on(build_check.images("ELF file    1: _C.1.sm_90.cubin"), 8, 9) is None


def test_registered_cuda_ops_are_read_from_the_bindings():
    ops = build_check.registered_cuda_ops()
    assert "cross_attention_fwd" in ops and "batched_cholesky_solve" in ops and len(ops) == len(set(ops)) >= 10


def _write_stage_files(out, rows, env=None, logs=None):
    out.mkdir(parents=True, exist_ok=True)
    (out / "stages.tsv").write_text("".join("\t".join(r) + "\n" for r in rows))
    if env:
        (out / "env.txt").write_text("".join(f"{k}: {v}\n" for k, v in env.items()))
    for stage, text in (logs or {}).items():
        (out / f"{stage}.log").write_text(text)


def test_report_names_the_card_and_what_was_not_validated(tmp_path):
    out = tmp_path / "gpu"
    env = {"card": "NVIDIA H100 80GB HBM3", "capability": "9.0", "torch": "2.11.0+cu130", "triton": "3.6.0"}
    rows = [("env", "PASS", "4", "", "2026-01-01T00:00:00Z", "abc"),
            ("build", "PASS", "120", "", "2026-01-01T00:02:00Z", "abc"),
            ("tests", "FAIL", "80", "exit status 1", "2026-01-01T00:03:30Z", "abc"),
            ("sanitize", "NOT RUN", "0", "an earlier stage failed", "2026-01-01T00:03:30Z", "abc"),
            ("bench", "PASS", "100", "", "2025-12-31T00:00:00Z", "old")]
    logs = {"build": "ninja: lots\nCUDA kernels registered: 12 of 12\nthis card (9.0) runs the sm_90 cubin\n",
            "tests": "." * 40 + "F\nFAILED python_tests/gpu/test_gpu_tree.py::test_x[cuda] - AssertionError\n"
                     "1 failed, 40 passed in 70.0s\n"}
    _write_stage_files(out, rows, env, logs)
    (out / "bench.md").write_text("# GPU benchmarks\n\n## Cross attention\n\n| a |\n")
    text, summary = report.render(out, ["env", "tests"], "200")
    assert text.startswith("# attn_ext GPU check: NVIDIA H100 80GB HBM3 (compute capability 9.0)")
    assert "torch 2.11.0+cu130" in text and "Commit abc" in text
    assert "| tests | **FAIL** | 80 | exit status 1 |" in text
    assert "old (earlier commit)" in text  # the bench row of an earlier run is kept, and marked
    assert "Not validated by this report: tests, sanitize." in text
    assert "CUDA kernels registered: 12 of 12" in text and "ninja: lots" not in text  # key lines only
    assert "1 failed, 40 passed" in text and "FAILED python_tests/gpu/test_gpu_tree.py" in text
    assert "### Cross attention" in text  # the bench tables, one heading level down
    assert "tests     FAIL" in summary  # check.sh prints where the report went (the result folder)
    assert report.main([str(out), "--stages", "env"]) == 0 and (out / "report.md").exists()


def test_report_without_any_stage_file(tmp_path):
    text, summary = report.render(tmp_path, [], None)
    assert "no GPU found" in text and "Not validated by this report: env, build, tests, sanitize, bench." in text


def test_attention_calls_take_the_input_copies_in_turn_and_the_table_has_causal_rows():
    seen = []

    def fn(q, k, v, causal):
        seen.append((q.data_ptr(), causal))
        return q * k.sum() + v

    copies = [tuple(torch.randn(2, 3, requires_grad=False) for _ in range(4)) for _ in range(3)]
    call = attention.pass_call(fn, "fwd", copies, True)
    for _ in range(4):
        call()
    assert [p for p, _ in seen] == [c[0].data_ptr() for c in copies] + [copies[0][0].data_ptr()]
    assert all(causal for _, causal in seen)
    grads = attention.pass_call(fn, "fwd+bwd", copies[:1], False)()
    assert len(grads) == 3 and torch.equal(grads[2], copies[0][3])  # d(out)/dv = grad_out
    rows = [{"section": "attention", "dtype": "bf16", "D": 64, "N": 1024, "M": 1024, "causal": causal, "pass": "fwd",
             "impl": impl, "flops": 1.0, "tflops": 100.0, "vs_sdpa": 1.0, "peak_mib": 1.0}
            for causal in (False, True) for impl in attention.IMPLS[:-1]]
    rows.append({**rows[0], "impl": "triton", "note": "not measured: why"})
    text = attention.markdown(rows)
    assert "| causal |" in text and "| none |" in text and "triton bf16 D=64 N=1,024 none fwd: not measured: why" in text
