"""The Triton AOT check (bench/gpu/triton_aot.py): which compiles it chooses, how it reads the results,
and, where Triton is installed, that it finds every kernel and compiles one for sm_80 without a GPU."""
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))

from triton_aot_capture import Job  # noqa: E402
from triton_aot_cases import Case, all_cases, select  # noqa: E402
from triton_aot_compile import resource_usage  # noqa: E402
from triton_aot_pool import run_pool  # noqa: E402
from triton_aot_report import Row, summary  # noqa: E402
from triton_aot_target import TARGETS  # noqa: E402

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
KERNELS = {"_fwd_kernel", "_bwd_preprocess", "_bwd_dkdv", "_bwd_dq", "_merge_fwd_kernel", "_merge_bwd_kernel",
           "_tree_fwd_kernel", "_policy_grad_kernel", "_tree_bwd_kernel", "_transposed_product_kernel",
           "_row_product_kernel", "_dkdv_kernel", "_solve_kernel"}


def _case(dtype, dims):
    return Case("family", dtype, dims, lambda: None)


def _job(tiles, dtype="float16", stride=64, kernel="k", target="sm_80"):
    options = tuple(sorted({"BLOCK_D": 64, "BLOCK_M": tiles[0], "num_warps": tiles[1]}.items()))
    return Job("m", kernel, (("tensor", dtype), stride), options, target, ("BLOCK_M", "num_warps"))


def test_ci_scope_compiles_every_config_per_element_size_of_dot_kernels_and_every_case_once():
    fp32, fp16, bf16 = _case("fp32", "D=64"), _case("fp16", "D=64"), _case("bf16", "D=64")
    d40 = _case("fp16", "D=40")
    configs = [(64, 4), (32, 4), (16, 2)]
    jobs = {}
    for case, dtype, stride in ((fp32, "float32", 64), (fp16, "float16", 64), (bf16, "bfloat16", 64),
                                (d40, "float16", 40)):
        for tiles in configs:  # the same constexprs for all: D = 40 and 64 share BLOCK_D = 64
            jobs[_job(tiles, dtype, stride)] = [case]

    def per_case(chosen):
        return [len([j for j, cs in chosen.items() if c in cs]) for c in (fp32, fp16, bf16, d40)]

    # A tl.dot kernel: every config for fp32 and for the 16-bit types (their shared memory differs);
    # bf16 and the unaligned D = 40 once each.
    assert per_case(select(jobs, "ci", dot_kernels={"k"})) == [3, 3, 1, 1]
    # Without tl.dot, fp32 stands for every dtype.
    assert per_case(select(jobs, "ci")) == [3, 1, 1, 1]
    assert select(jobs, "full") == jobs
    with pytest.raises(ValueError, match="scope"):
        select(jobs, "most")


def test_ci_scope_keeps_each_target_and_kernel():
    case = _case("fp16", "D=64")
    jobs = {_job((64, 4), kernel=k, target=t): [case] for k in ("a", "b") for t in ("sm_80", "sm_90")}
    assert select(jobs, "ci") == jobs


def test_cases_cover_every_dtype_and_head_dim():
    cases = all_cases()
    assert {c.family for c in cases} == {"cross_attention", "attention", "merge", "tree", "intention"}
    for family in ("cross_attention", "attention", "merge", "tree", "intention"):
        assert {c.dtype for c in cases if c.family == family} == {"fp32", "fp16", "bf16"}
    head_dims = {c.dims for c in cases if c.family == "cross_attention"}
    assert head_dims == {f"D={d}" for d in (16, 40, 64, 128, 256)}
    attention_dims = {c.dims for c in cases if c.family == "attention"}
    assert attention_dims == {f"D={d} mask" for d in (16, 40, 64, 128, 256)} | {"D=64 causal", "D=128 causal"}


def test_resource_usage_reads_the_named_function():
    dump = ("Resource usage:\n Common:\n  GLOBAL:11\n Function other:\n  REG:12 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:1\n"
            " Function _fwd_kernel:\n  REG:168 STACK:16 SHARED:0 LOCAL:8 CONSTANT[0]:520 TEXTURE:0 SURFACE:0\n")
    assert resource_usage(dump, "_fwd_kernel") == {"regs": 168, "stack": 16, "local": 8}
    with pytest.raises(ValueError, match="no function"):
        resource_usage(dump, "_bwd_dq")


def test_problems_are_compile_errors_and_shared_memory_over_the_limit():
    job, case, sm80 = _job((64, 4)), _case("fp16", "D=64"), TARGETS["sm_80"]
    ok = {"regs": 100, "shared": sm80.max_shared, "stack": 0, "local": 0, "seconds": 1.0}
    over = dict(ok, shared=sm80.max_shared + 1)
    rows = [Row(job, [case], ok, sm80), Row(job, [case], over, sm80),
            Row(job, [case], {"error": "CompilationError: boom", "seconds": 0.1}, sm80)]
    assert [r.problem is None for r in rows] == [True, False, False]
    assert "166913 bytes of shared memory, over the 166912 of sm_80" in rows[1].problem
    text, failed = summary(rows, missing=[])
    assert failed and "CompilationError: boom" in text
    text, failed = summary(rows[:1], missing=["attn_ext.ops.x.new_kernel"])
    assert failed and "new_kernel has no AOT case" in text
    assert not summary(rows[:1], missing=[])[1]


def test_pool_stops_a_task_past_its_time_limit():
    results = {}
    start = time.monotonic()
    run_pool(time.sleep, [0, 60, 0], workers=2, timeout=3, on_result=results.__setitem__)
    assert time.monotonic() - start < 30
    assert results[0] is None and results[2] is None
    assert "still running after 3 s" in results[1]["error"]


def _aot(*args, timeout=300):
    # TRITON_INTERPRET=1 (set by the test configuration) must not reach the kernels: the script drops it.
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "triton_aot.py"), *args],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


@needs_triton
def test_list_finds_every_kernel_for_both_targets():
    done = _aot("--list")
    assert done.returncode == 0, done.stderr
    listed = {tuple(line.split()[:2]) for line in done.stdout.splitlines() if line.startswith("sm_")}
    assert listed == {(target, kernel) for target in ("sm_80", "sm_90") for kernel in KERNELS}


@needs_triton
def test_compiles_the_merge_kernels_for_sm80(tmp_path):
    out = tmp_path / "aot.md"
    done = _aot("--targets", "sm_80", "--kernels", "^_merge_fwd_kernel$", "--cache-dir", str(tmp_path / "cache"),
                "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "15 compiles (0 cached, 15 to do)" in done.stdout
    rows = [line for line in out.read_text().splitlines() if line.startswith("| _merge_fwd_kernel")]
    assert len(rows) == 15 and all(row.endswith("| ok |") for row in rows)
    again = _aot("--targets", "sm_80", "--kernels", "^_merge_fwd_kernel$", "--cache-dir", str(tmp_path / "cache"),
                 "--out", str(out))
    assert again.returncode == 0 and "15 compiles (15 cached, 0 to do)" in again.stdout


@needs_triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the interpreter's kernels")
def test_capture_refuses_kernels_built_for_the_interpreter():
    # Interpreted kernels launch without JITFunction.run: the check would record nothing and pass.
    from triton_aot_capture import capture

    with pytest.raises(RuntimeError, match="interpreter"):
        capture(TARGETS["sm_80"], all_cases())
