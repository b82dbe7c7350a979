"""The Triton TE-attention kernels compiled for sm_80 and sm_90 (Triton's AOT path, no GPU needed) at TE-TNP's sizes
(4 heads, head dim 16, 2-D inputs, hidden 64, fp16 and fp32 inputs): they compile, and keep every tile in registers
(no local memory), as the tile choice of attn_ext/ops/te_attention/triton_fwd.py promises."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = r"""
import json, sys
sys.path.insert(0, "bench/gpu")
from triton_aot_compile import compile_job
from attn_ext.ops.te_attention.triton_fwd import HIDDEN_CHUNK, NUM_WARPS

dtype = sys.argv[1]
t = lambda name: ("tensor", name)
sizes = dict(H=4, DX=2, ACT=0, HAS_MASK=True, BLOCK_M=16, BLOCK_N=16, BLOCK_D=16, BLOCK_DV=16, BLOCK_H=4,
             BLOCK_F=8, BLOCK_HIDDEN=64, HIDDEN_CHUNK=HIDDEN_CHUNK, num_warps=NUM_WARPS, num_stages=1)
ints = [64] * 20
fwd = [t(dtype)] * 9 + [t("uint8"), t(dtype), t("float32")] + ints + [64] * 7 + [1024, 1024, 16, 16, 64, 0.25]
bwd = [t(dtype)] * 9 + [t("uint8"), t(dtype), t("float32"), t("float32")] + [t("float32")] * 9 + ints + [64] * 4 + \
      [1024, 1024, 16, 16, 64, 0.25]
results = {}
for target in ("sm_80", "sm_90"):
    for name, kernel, args, extra in (("fwd", "_te_fwd_kernel", fwd, {}), ("bwd", "_te_bwd_kernel", bwd, {"BLOCK_DX": 2})):
        job = {"module": f"attn_ext.ops.te_attention.triton_{name}", "kernel": kernel, "args": args,
               "options": list({**sizes, **extra}.items()), "target": target}
        result = compile_job(job)
        results[f"{target} {name}"] = {k: v for k, v in result.items() if k != "sass"}
print(json.dumps(results))
"""


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_compiles_without_local_memory(dtype):
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT, dtype], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for kernel, result in results.items():
        assert "error" not in result, f"{kernel}: {result['error']}"
        assert result["stack"] == 0 and result["local"] == 0, f"{kernel} spills: {result}"
