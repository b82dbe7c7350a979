"""The CUDA machine-code report (bench/gpu/cuda_sass.py and its parts), without nvcc: the kernel names it
shortens, the rows and table it reads from a made-up cuobjdump dump, the command line it derives from the
build's, and the criteria's verdicts on today's code, a regression and a known gap that now holds."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))

import cuda_sass  # noqa: E402
from cuda_sass_criteria import KNOWN_GAPS, REQUIREMENTS  # noqa: E402
from cuda_sass_parse import kernel_and_config, resource_usage, rows  # noqa: E402
from cuda_sass_report import grouped, markdown, table  # noqa: E402
from sass_criteria import GAP, PASS, SassRow, check, findings  # noqa: E402
from sass_opcodes import COUNTS  # noqa: E402

FWD_BF16 = "_ZN8attn_ext4cuda6detail31cross_attention_fwd_wmma_kernelI13__nv_bfloat16Li64ELi4ELb1EEEvNS0_1PE"
FWD_FP16 = "_ZN8attn_ext4cuda6detail31cross_attention_fwd_wmma_kernelI6__halfLi128ELi2ELb0EEEvNS0_1PE"
NAMES = {FWD_BF16: "void attn_ext::cuda::detail::cross_attention_fwd_wmma_kernel<__nv_bfloat16, 64, 4, true>"
                   "(attn_ext::cuda::CrossAttentionFwdParams)",
         FWD_FP16: "void attn_ext::cuda::detail::cross_attention_fwd_wmma_kernel<__half, 128, 2, false>"
                   "(attn_ext::cuda::CrossAttentionFwdParams)"}

# Two kernels as `cuobjdump -sass` prints them (trimmed): predicated instructions, encodings, a LDGSTS of
# 16 bytes whose cache hint also says 128, a 2-byte global load and a spill.
DUMP = f"""
\tcode for sm_80
\t\tFunction : {FWD_BF16}
\t.headerflags\t@"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM80"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
        /*0010*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;  /* 0x000000000c04723c */
        /*0020*/                   HMMA.16816.F32.BF16 R16, R8, R14, R16 ;
        /*0030*/                   LD.E R8, desc[UR4][R2.64] ;
        /*0040*/              @!P0 LDG.E.U16 R9, desc[UR4][R6.64] ;
        /*0050*/                   STL [R1+0x4], R9 ;
        /*0060*/                   LDL R9, [R1+0x4] ;
        /*0070*/                   EXIT ;
\t\t..........

\t\tFunction : {FWD_FP16}
        /*0000*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0010*/                   LDSM.16.M88.4 R8, [R2] ;
        /*0020*/               @P1 LDGSTS.E.BYPASS.LTC128B.128 [R3], desc[UR4][R4.64] ;
        /*0030*/                   LDGSTS.E [R3+0x10], desc[UR4][R4.64+0x10] ;
        /*0040*/                   LDG.E.128 R12, desc[UR4][R6.64] ;
        /*0050*/                   EXIT ;
"""
USAGE = f"""
Resource usage:
 Common:
  GLOBAL:0
 Function {FWD_BF16}:
  REG:110 STACK:8 SHARED:1024 LOCAL:0 CONSTANT[0]:776 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function {FWD_FP16}:
  REG:80 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:776 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


@pytest.mark.parametrize("demangled, expected", [
    (NAMES[FWD_BF16], ("attention_fwd_wmma", "bf16 D=64 w4 masks")),
    (NAMES[FWD_FP16], ("attention_fwd_wmma", "fp16 D=128 w2")),
    ("void attn_ext::cuda::detail::attention_fwd_mma_kernel<__nv_bfloat16, 128, true>(P)",
     ("attention_fwd_mma", "bf16 D=128 masks")),
    ("void attn_ext::cuda::detail::attention_fwd_mma_kernel<__half, 64, false>(P)", ("attention_fwd_mma", "fp16 D=64")),
    ("void attn_ext::cuda::detail::attention_bwd_mma_kernel<__half, 128, true, false>(P)",
     ("attention_bwd_mma", "fp16 D=128 dkdv")),
    ("void attn_ext::cuda::detail::attention_bwd_mma_kernel<__nv_bfloat16, 32, false, true>(P)",
     ("attention_bwd_mma", "bf16 D=32 dq masks")),
    ("void attn_ext::cuda::detail::cross_attention_bwd_wmma_kernel<__half, 64, 2, true, false>(P)",
     ("attention_bwd_wmma", "fp16 D=64 w2 dkdv")),
    ("void attn_ext::cuda::detail::cross_attention_bwd_wmma_kernel<__nv_bfloat16, 128, 4, false, true>(P)",
     ("attention_bwd_wmma", "bf16 D=128 w4 dq masks")),
    ("void attn_ext::cuda::detail::cross_attention_fwd_kernel<float, 64, 32, 8, 4, false>(P)",
     ("attention_fwd", "fp32 D=64 Dv=32 rows8 w4")),
    ("void attn_ext::cuda::detail::merge_states_fwd_kernel<__half>(attn_ext::cuda::MergeStatesParams)",
     ("merge_states_fwd", "fp16")),
    # Not described: the arguments as they are; an anonymous namespace is dropped.
    ("void attn_ext::cuda::(anonymous namespace)::new_kernel<float, 3, true>(int, float*)", ("new", "fp32 3 true")),
    ("void plain_kernel(int)", ("plain", "")),
    # A described kernel whose template changed shows as a different kernel (the criteria then fail it).
    ("void attn_ext::cuda::detail::cross_attention_fwd_wmma_kernel<__half, 64, 4>(P)",
     ("attention_fwd_wmma<3 args>", "fp16 64 4")),
])
def test_kernel_names_are_shortened(demangled, expected):
    assert kernel_and_config(demangled) == expected


def test_rows_from_a_dump():
    found = {r.config: r for r in rows(DUMP, USAGE, "sm_80", NAMES, spills={FWD_BF16: (4, 4)})}
    assert set(found) == {"bf16 D=64 w4 masks", "fp16 D=128 w2"}
    bf16, fp16 = found["bf16 D=64 w4 masks"], found["fp16 D=128 w2"]
    assert bf16.kernel == fp16.kernel == "attention_fwd_wmma" and bf16.target == "sm_80"
    assert (bf16.counts["HMMA"], bf16.counts["HMMA.16816"], bf16.counts["LDSM"], bf16.counts["LDG"]) == (2, 2, 0, 1)
    assert (bf16.counts["LDL"], bf16.counts["STL"], bf16.counts["LDG.128"]) == (1, 1, 0)
    assert bf16.resources == {"regs": 110, "stack": 8, "shared": 1024, "local": 0, "spill_stores": 4, "spill_loads": 4}
    assert [fp16.counts[c] for c in ("LDSM", "LDGSTS", "LDGSTS.128", "LDG.128")] == [1, 2, 1, 1]
    assert "spill_stores" not in fp16.resources  # no ptxas log for it: unknown, not 0
    assert resource_usage(USAGE)[FWD_FP16] == {"regs": 80, "stack": 0, "shared": 0, "local": 0}


def test_table_and_summary_show_every_row_and_verdict():
    found = rows(DUMP, USAGE, "sm_80", NAMES, spills={FWD_BF16: (4, 4)})
    results = findings(found, REQUIREMENTS, KNOWN_GAPS)
    lines = table(found, results)
    assert lines[0].count("|") == 3 + 4 + len(COUNTS) + 2
    bf16 = next(line for line in lines if "bf16 D=64 w4 masks" in line)
    assert "| 110 | 4/4 | 8 | 1024 | 0 | 2 | 2 | 0 |" in bf16  # regs, spills, stack, smem, HGMMA, HMMA, .16816, LDSM
    assert "REGRESSION**: LDL == 0" in bf16 and "gap: LDSM > 0" in bf16
    fp16 = next(line for line in lines if "fp16 D=128 w2" in line)
    assert "| ? |" in fp16 and "REGRESSION" not in fp16
    assert len(grouped(found)) == 2 + 2  # header, rule, one line per dtype
    text = markdown(found, results, "origin", 1.0)
    assert "## Failures" in text and "REGRESSION: attention_fwd_wmma sm_80 bf16 D=64 w4 masks: LDL == 0" in text


def _row(kernel, config, target="sm_80", stack=0, **counts):
    base = dict.fromkeys(COUNTS, 0)
    return SassRow(kernel, target, config, {**base, **counts}, {"regs": 100, "stack": stack, "shared": 0, "local": 0})


def _today():
    """The tensor-core kernels as they compile today: HMMA.16816, ldmatrix in fp16 only, no cp.async."""
    out = []
    for target in ("sm_80", "sm_90", "sm_90a"):
        for kernel in ("attention_fwd_wmma", "attention_bwd_wmma"):
            extra = " dkdv" if kernel == "attention_bwd_wmma" else ""
            out.append(_row(kernel, f"fp16 D=64 w4{extra}", target, HMMA=20, **{"HMMA.16816": 20, "LDSM": 20}))
            out.append(_row(kernel, f"bf16 D=64 w4{extra}", target, HMMA=20, **{"HMMA.16816": 20}))
        out.append(_row("attention_fwd", "fp32 D=64 Dv=64 rows8 w4", target))
        # The FlashAttention-2-style forward: the sm_80 mix; 8 bytes spilled at D = 128 with pair masks.
        mix = {"HMMA.16816": 96, "LDSM": 80, "LDGSTS": 24, "LDGSTS.128": 24}
        out.append(_row("attention_fwd_mma", "fp16 D=64", target, HMMA=96, **mix))
        out.append(_row("attention_fwd_mma", "bf16 D=128 masks", target, stack=8, HMMA=96, LDL=2, STL=2, **mix))
    return out


def test_today_passes_with_its_gaps_reported_as_gaps():
    rows_today = _today()
    assert check(rows_today, REQUIREMENTS, KNOWN_GAPS) == []
    results = findings(rows_today, REQUIREMENTS, KNOWN_GAPS)
    gaps = {(f.kernel, f.target, f.config.split()[0], f.requirement) for f in results if f.status == GAP}
    assert ("attention_fwd_wmma", "sm_80", "bf16", "LDSM > 0") in gaps
    assert ("attention_bwd_wmma", "sm_90a", "fp16", "LDGSTS.128 > 0") in gaps
    assert ("attention_fwd_mma", "sm_90a", "bf16", "HGMMA > 0") in gaps
    assert ("attention_fwd_mma", "sm_80", "bf16", "STL == 0") in gaps
    passed = {(f.kernel, f.config.split()[0], f.requirement) for f in results if f.status == PASS}
    assert ("attention_fwd_wmma", "fp16", "LDSM > 0") in passed and ("attention_fwd", "fp32", "STL == 0") in passed
    assert ("attention_fwd_mma", "fp16", "LDGSTS.128 > 0") in passed and ("attention_fwd_mma", "fp16", "LDL == 0") in passed


@pytest.mark.parametrize("change, status, requirement", [
    # fp16 loses its ldmatrix: not covered by the bf16-only gap.
    (lambda r: r.config.startswith("fp16") and r.kernel == "attention_fwd_wmma", "REGRESSION", "LDSM > 0"),
    # A spill in a scalar kernel.
    (lambda r: r.kernel == "attention_fwd" and r.target == "sm_90", "REGRESSION", "LDL == 0"),
    # The tensor cores gone.
    (lambda r: r.kernel == "attention_bwd_wmma" and r.target == "sm_80", "REGRESSION", "HMMA.16816 > 0"),
])
def test_a_regression_fails(change, status, requirement):
    broken = {"LDSM > 0": {"LDSM": 0}, "LDL == 0": {"LDL": 3}, "HMMA.16816 > 0": {"HMMA.16816": 0}}[requirement]
    rows_now = [SassRow(r.kernel, r.target, r.config, {**r.counts, **broken}, r.resources) if change(r) else r
                for r in _today()]
    failures = check(rows_now, REQUIREMENTS, KNOWN_GAPS)
    assert failures and {(f.status, f.requirement) for f in failures} == {(status, requirement)}


def test_a_gap_that_holds_fails_until_removed():
    # bf16 gets ldmatrix in the forward (item 3 done there): the forward's bf16 LDSM gap must go.
    rows_now = [SassRow(r.kernel, r.target, r.config, {**r.counts, "LDSM": 8}, r.resources)
                if r.kernel == "attention_fwd_wmma" and r.config.startswith("bf16") else r for r in _today()]
    failures = check(rows_now, REQUIREMENTS, KNOWN_GAPS)
    assert [(f.status, f.requirement) for f in failures] == [("GAP CLOSED", "LDSM > 0")]
    assert "attention_fwd_wmma" in failures[0].kernel
    remaining = [g for g in KNOWN_GAPS if not (g.kernel_pattern == "attention_fwd_wmma" and g.requirement_name
                                                == "LDSM > 0")]
    assert check(rows_now, REQUIREMENTS, remaining) == []


def test_an_unknown_kernel_is_not_passed():
    failures = check(_today() + [_row("attention_fwd_sm90", "bf16 D=128", "sm_90a")], REQUIREMENTS, KNOWN_GAPS)
    assert [(f.status, f.kernel) for f in failures] == [("UNCHECKED", "attention_fwd_sm90")]


def test_every_gap_names_a_requirement():
    names = {r.name for r in REQUIREMENTS}
    assert all(g.requirement_name in names and g.why.startswith("issue 43 item 3") for g in KNOWN_GAPS)


def test_the_build_command_becomes_a_cubin_command(tmp_path):
    tokens = ["/usr/local/bin/nvcc", "-forward-unknown-to-host-compiler", "--options-file", "inc.rsp", "-O3",
              "--generate-code=arch=compute_80,code=[compute_80,sm_80]", "-gencode", "arch=compute_90,code=sm_90",
              "-Xcompiler=-fPIC", "--threads", "2", "-MD", "-MT", "x.o", "-MF", "x.o.d", "-std=c++17", "-x", "cu",
              "-c", "/src/a.cu", "-o", "CMakeFiles/a.cu.o"]
    assert cuda_sass.object_of(tokens, tmp_path) == tmp_path / "CMakeFiles/a.cu.o"
    cmd = cuda_sass.cubin_command(tokens, "sm_90a", tmp_path / "a.cubin")
    assert cmd[-5:] == ["-Xptxas=-v", "-cubin", "-arch=sm_90a", "-o", str(tmp_path / "a.cubin")]
    assert not any(t.startswith(("--generate-code", "arch=")) or t in ("-gencode", "-c", "-MD", "x.o", "x.o.d")
                   for t in cmd)
    assert ["--options-file", "inc.rsp"] == cmd[2:4] and "/src/a.cu" in cmd and ["--threads", "2"] == cmd[6:8]
    verbose = cuda_sass.cubin_command(tokens + ["-Xptxas=-v"], "sm_80", tmp_path / "b.cubin")
    assert verbose.count("-Xptxas=-v") == 1


def test_spills_from_a_ptxas_log():
    log = ("ptxas info    : Compiling entry function '_Z1kv' for 'sm_90a'\n"
           "ptxas info    : Function properties for _Z1kv\n"
           "    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers\n")
    assert cuda_sass.spills_of(log) == {("_Z1kv", "sm_90a"): (8, 4)}


def _fake_run(monkeypatch, tmp_path, rows_now):
    monkeypatch.setattr(cuda_sass, "find_nvcc", lambda: "nvcc")
    monkeypatch.setattr(cuda_sass, "find_cuobjdump", lambda nvcc: "cuobjdump")
    monkeypatch.setattr(cuda_sass, "plan", lambda *a, **k: ([cuda_sass.Job(Path("a.cu"), "sm_80", Path("a.o"),
                                                                                 tmp_path)], ["sm_80"]))
    monkeypatch.setattr(cuda_sass, "run_job", lambda job, cuobjdump, spills: rows_now)
    return cuda_sass.main(["--build-dir", str(tmp_path), "--out", str(tmp_path / "out.md")])


def test_main_exit_status_follows_the_check(monkeypatch, tmp_path, capsys):
    assert _fake_run(monkeypatch, tmp_path, _today()) == 0
    assert "gap (issue 43): attention_fwd_wmma bf16 sm_80: LDSM > 0" in capsys.readouterr().out
    assert "## Known gaps (issue 43)" in (tmp_path / "out.md").read_text()
    spilled = [SassRow(r.kernel, r.target, r.config, {**r.counts, "STL": 2}, r.resources) for r in _today()]
    assert _fake_run(monkeypatch, tmp_path, spilled) == 1
    assert "FAILED" in capsys.readouterr().out


def test_without_the_tools_it_skips(monkeypatch, capsys):
    monkeypatch.setattr(cuda_sass, "find_nvcc", lambda: None)
    assert cuda_sass.main([]) == 0
    assert capsys.readouterr().out.startswith("SKIP")
