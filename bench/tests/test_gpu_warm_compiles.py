"""The GPU benchmark's warm-up compiles an attention case's Triton kernels at a small stand-in size
(bench.gpu.attention.warm_case): it pays only if the stand-in compiles exactly the kernels the case does.

Checked without a GPU by recording the launches of the Triton launchers for sm_90 (bench/gpu/triton_aot_capture.py:
every config the autotuner's pruning keeps, with the card's shared memory) for each case of the benchmark's grid
and for its stand-in, and comparing what Triton compiles for them: the kernel, its constexprs and launch options,
and its arguments as Triton specialises them (a tensor by its dtype, an integer by being 1, a multiple of 16 or
neither, and 32- or 64-bit). In a fresh process: the capture needs the kernels built for the GPU, not the
interpreter that the CPU suite sets up.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import sys
    sys.path[:0] = [{root!r}, {gpu!r}]
    import torch
    from bench.gpu import attention
    from attn_ext.ops.attention.chunked import DEFAULT_CHUNK_SIZE
    from attn_ext.ops.attention.triton_bwd import attention_backward
    from attn_ext.ops.attention.triton_fwd import attention_forward
    from triton_aot_cases import Case
    from triton_aot_capture import capture
    from triton_aot_target import TARGETS

    def specialised(value):
        if isinstance(value, bool) or not isinstance(value, int):
            return value
        kind = "one" if value == 1 else "multiple of 16" if value % 16 == 0 else "other"
        return kind, "i32" if -2**31 <= value < 2**31 else "i64"

    def compiles(case):
        # What ae.scaled_dot_product_attention(q, k, v, is_causal=..., backend="triton") launches, forward and backward.
        def call():
            shape = (attention.B, attention.H, case.n, case.d)
            dtype = attention.DTYPES[case.dtype]
            q, k, v = (torch.zeros(shape, dtype=dtype) for _ in range(3))
            args = (None, None, case.d ** -0.5, case.causal, 0.0, None, DEFAULT_CHUNK_SIZE)
            attention_forward(q, k, v, *args)
            out, lse = torch.zeros(shape, dtype=dtype), torch.zeros(shape[:3])
            attention_backward(torch.ones_like(out), None, q, k, v, None, None, out, lse, *args[2:])
        jobs = capture(TARGETS["sm_90"], [Case("attention", case.dtype, case.label, call)])
        return {{(job.kernel, tuple(map(specialised, job.args)), job.options) for job in jobs}}

    for case in attention.cases():
        mine, stand_in = compiles(case), compiles(attention.warm_case(case))
        print(case.label, len(mine), len(mine ^ stand_in), sep="\t")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_warm_up_stand_in_compiles_what_each_case_compiles():
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("TRITON_INTERPRET", "ATTN_EXT_TRITON_PIN")}
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(root=str(ROOT), gpu=str(ROOT / "bench" / "gpu"))],
                          cwd=ROOT, env={**environment, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 24, done.stdout  # the whole grid: fp16 and bf16, D 64 and 128, three N, causal or not
    for line in lines:
        label, count, different = line.split("\t")
        # every config of the three kernels that the pruning keeps (the spill table drops the ones that spill where a
        # spill-free full-rate one is left: 27 of 40-odd for fp16 D = 64 causal)
        assert int(count) >= 15, line
        assert int(different) == 0, f"{label}: {different} compiles differ between the case and its stand-in"
