"""The C++ kernels' MLP loops are compiled once per instruction set (AVX-512, AVX2, SSE2) and chosen at their first
call: each copy, forced by ``ATTN_EXT_CPU_ISA`` in a fresh process, gives the dense formula's output and gradients
(fp64 and fp32, every activation, a pair count that leaves a one-vector tail)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from attn_ext.ops.utils.extension import extension_error

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = r"""
import torch, attn_ext as ae
from python_tests.te_attention._te_problems import dense, make_mask, make_problem
worst = 0.0
for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 2e-4)):
    for activation in ("relu", "gelu", "silu", "tanh"):
        problem = [t.to(dtype).requires_grad_() for t in make_problem(2, 3, 7, 41, 5, 4, 2, 9, seed=4)]
        mask = make_mask(2, 41, "padding")
        out = ae.te_attention(*problem, key_padding_mask=mask, activation=activation, backend="cpp")
        exact = [t.detach().double().requires_grad_() for t in problem]
        ref = dense(exact, mask, activation)[0]
        ours = torch.autograd.grad(out.sum(), problem)
        theirs = torch.autograd.grad(ref.sum(), exact)
        for a, b in zip((out, *ours), (ref, *theirs)):
            err = float((a.double() - b).abs().max() / (1 + b.abs().max()))
            assert err < tol, (dtype, activation, err)
print("ok")
"""


@pytest.mark.skipif(extension_error() is not None, reason=f"attn_ext._C is not loaded: {extension_error()}")
@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
def test_every_instruction_set_copy(isa):
    env = dict(os.environ, ATTN_EXT_CPU_ISA=isa, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
