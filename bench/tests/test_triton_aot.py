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
from triton_aot_cases import Case, all_cases, in_sass_scope, select  # noqa: E402
from triton_aot_compile import resource_usage  # noqa: E402
from triton_aot_pool import run_pool  # noqa: E402
from triton_aot_report import Row, summary, table  # noqa: E402
from triton_aot_sass import ci_cover, group_table, judge, report_lines  # noqa: E402
from triton_aot_target import TARGETS  # noqa: E402

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
KERNELS = {"_fwd_kernel", "_bwd_preprocess", "_bwd_dkdv", "_bwd_dq", "_merge_fwd_kernel", "_merge_bwd_kernel",
           "_tree_fwd_kernel", "_policy_grad_kernel", "_tree_bwd_kernel", "_transposed_product_kernel",
           "_row_product_kernel", "_dkdv_kernel", "_solve_kernel", "_te_fwd_kernel", "_te_bwd_kernel"}


def _case(dtype, dims):
    return Case("family", dtype, dims, lambda: None)


def _job(tiles, dtype="float16", stride=64, kernel="k", target="sm_80"):
    options = tuple(sorted({"BLOCK_D": 64, "BLOCK_M": tiles[0], "num_warps": tiles[1]}.items()))
    return Job("m", kernel, (("tensor", dtype), stride), options, target, ("BLOCK_M", "num_warps"))


def test_ci_scope_compiles_every_config_per_element_size_of_dot_kernels_and_every_case_once():
    fp32, fp16, bf16 = _case("fp32", "D=64"), _case("fp16", "D=64"), _case("bf16", "D=64")
    d40 = _case("fp16", "D=40")
    configs = [(16, 2), (32, 4), (64, 4)]  # the largest last
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
    # The case compiled once gets the largest config (the one most likely to spill), wherever it is listed.
    assert [j for j, cs in select(jobs, "ci", dot_kernels={"k"}).items() if bf16 in cs] == [_job((64, 4), "bfloat16")]
    assert _job((64, 4)).tile_area() == 64
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
    assert {c.family for c in cases} == {"cross_attention", "attention", "attention_tma", "merge", "tree", "intention",
                                         "te_attention"}
    for family in ("cross_attention", "attention", "merge", "tree", "intention", "te_attention"):
        assert {c.dtype for c in cases if c.family == family} == {"fp32", "fp16", "bf16"}
    # The Hopper TMA forward takes the 16-bit types only, at the head dims of the machine-code criteria.
    assert {(c.dtype, c.dims) for c in cases if c.family == "attention_tma"} == {
        (dtype, f"D={d}{variant}") for dtype in ("fp16", "bf16") for d in (64, 128)
        for variant in ("", " N=256", " causal")}
    assert {c.dims for c in cases if c.family == "te_attention"} == {"D=16", "D=64"}
    head_dims = {c.dims for c in cases if c.family == "cross_attention"}
    assert head_dims == {f"D={d}" for d in (16, 40, 64, 128, 256)}
    attention_dims = {c.dims for c in cases if c.family == "attention"}
    assert attention_dims == ({f"D={d} mask" for d in (16, 40, 64, 128, 256)}
                              | {f"D={d} {variant}" for d in (64, 128)
                                 for variant in ("causal", "causal dropout", "scored", "varlen causal", "varlen scored",
                                                 "decode split", "paged")})


def test_sass_scope_is_the_attention_kernels_at_the_issues_dtypes_and_head_dims():
    scope = {(c.family, c.dtype, c.dims) for c in all_cases() if in_sass_scope(c)}
    assert scope == {(family, dtype, dims) for dtype in ("fp16", "bf16") for d in (64, 128)
                     for family, dims in (("cross_attention", f"D={d}"), ("attention", f"D={d} mask"),
                                          ("attention", f"D={d} causal"), ("attention", f"D={d} causal dropout"),
                                          ("attention", f"D={d} scored"), ("attention", f"D={d} varlen causal"),
                                          ("attention", f"D={d} varlen scored"), ("attention", f"D={d} decode split"),
                                          ("attention", f"D={d} paged"), ("merge", f"Dv={d}"),
                                          ("attention_tma", f"D={d}"), ("attention_tma", f"D={d} N=256"),
                                          ("attention_tma", f"D={d} causal"))}
    # A job is in the scope when one of its cases is.
    inside, outside = Case("attention", "bf16", "D=128 causal", lambda: None), _case("bf16", "D=64 mask")
    jobs = {_job((64, 4)): [inside], _job((32, 4)): [outside], _job((16, 2)): [outside, inside]}
    assert list(select(jobs, "sass")) == [_job((64, 4)), _job((16, 2))]


def test_ci_cover_says_which_compiles_of_the_sass_scope_ci_leaves_out():
    fp16, bf16 = _case("fp16", "D=64 mask"), _case("bf16", "D=64 mask")
    sass = {_job((64, 4)): [fp16], _job((64, 4), "bfloat16"): [bf16], _job((32, 4), "bfloat16"): [bf16]}
    lines = ci_cover(sass, {_job((64, 4)): [fp16]})
    assert lines[0].startswith("CI's scope compiles 1 of these 3 compiles; of the 2 it leaves out, 1 have")
    assert "1 not at all" in lines[0]
    assert "only by `make sass-report`" in lines[1] and lines[1].endswith("bf16 D=64 mask: 2")
    assert ci_cover(sass, sass) == ["CI's scope compiles 3 of these 3 compiles; of the 0 it leaves out, 0 have "
                                    "their kernel, target, tiles and head dim compiled in CI for another dtype or "
                                    "variant, 0 not at all"]


def _sass_row(tiles, stack, kernel="_bwd_dq", target="sm_90", **counts):
    job = Job("m", kernel, (("tensor", "bfloat16"),), tuple(sorted({"BLOCK_M": tiles[0], "BLOCK_N": tiles[1],
                                                                   "num_warps": tiles[2]}.items())),
              target, ("BLOCK_M", "BLOCK_N", "num_warps"))
    good = {"HGMMA": 8, "UTMALDG": 4} if target == "sm_90" else {"HMMA.16816": 8, "LDSM": 4, "LDGSTS": 4}
    sass = {**dict.fromkeys(("HGMMA", "HMMA", "HMMA.16816", "LDSM", "LDGSTS", "UTMALDG", "LDL", "STL"), 0), **good,
            "LDL": stack // 8, "STL": stack // 8, **counts}
    result = {"regs": 255 if stack else 200, "stack": stack, "local": 0, "shared": 1024 * tiles[0], "sass": sass,
              "num_warps": tiles[2], "num_stages": 2, "seconds": 1.0}
    return Row(job, [Case("attention", "bf16", "D=128 causal", lambda: None)], result, TARGETS[target])


def test_the_machine_code_table_shows_the_largest_and_the_largest_spill_free_config():
    rows = [_sass_row((64, 32, 4), 0), _sass_row((128, 64, 8), 304), _sass_row((16, 16, 2), 0),
            _sass_row((64, 64, 4), 0, target="sm_80"), _sass_row((64, 64, 4), 0, kernel="_tree_fwd_kernel")]
    found = judge(rows)
    # Only the kernels the criteria know (and the known gaps, which these made-up kernels close).
    assert {f.kernel for f in found if not f.kernel.startswith("gap ")} == {"_bwd_dq"}
    lines = group_table(rows, found).splitlines()
    sm90 = next(line for line in lines if "| sm_90 |" in line)
    assert "| 3 | 2 | BLOCK_M=128 BLOCK_N=64 w8 s- | 255 | 304 |" in sm90
    assert "| BLOCK_M=64 BLOCK_N=32 w4 s- |" in sm90 and not sm90.endswith("| pass |")  # it spills
    assert next(line for line in lines if "| sm_80 |" in line).endswith("| pass |")
    verdict = report_lines(found)
    assert verdict[0].startswith("machine-code check: 4 compiles judged")
    assert any("stack == 0" in line and "304" in line for line in verdict)  # a gap or a failure, never hidden
    text = table(rows, "header", [], "## Machine code (issue 43)\n")
    assert text.index("## Machine code") < text.index("## Every compile") < text.index("| _bwd_dq |")
    assert "| HGMMA | HMMA |" in text


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
    # The Hopper TMA forward and backward are compiled for sm_90 alone (their dispatch takes them nowhere else).
    assert listed == {(target, kernel) for target in ("sm_80", "sm_90") for kernel in KERNELS} | {
        ("sm_90", "_fwd_tma_kernel"), ("sm_90", "_bwd_dkdv_tma_kernel"), ("sm_90", "_bwd_dq_tma_kernel")}


@needs_triton
def test_compiles_the_merge_kernels_for_sm80(tmp_path):
    out = tmp_path / "aot.md"
    done = _aot("--targets", "sm_80", "--kernels", "^_merge_fwd_kernel$", "--cache-dir", str(tmp_path / "cache"),
                "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "15 compiles (0 cached, 15 to do)" in done.stdout
    every_compile = out.read_text().split("## Every compile")[1]  # after the machine-code section's table
    rows = [line for line in every_compile.splitlines() if line.startswith("| _merge_fwd_kernel")]
    assert len(rows) == 15 and all(row.endswith("| ok |") for row in rows)
    assert "machine-code check: 4 compiles judged" in done.stdout  # fp16/bf16 at Dv = 64 and 128
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
