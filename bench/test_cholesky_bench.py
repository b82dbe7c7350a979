"""pytest-benchmark suite: attn_ext's batched Cholesky ops vs torch.linalg (SPEC §4, Intention).

Workload: fp32 SPD matrices ``A = Z Zᵀ/n + I`` on CPU, batch × n × n in {4096×64×64, 4096×32×32,
512×128×128}, with r = n right-hand sides (the Intention op solves (KᵀK + αI) W = KᵀV with
Dv = D). ``cholesky`` is ``attn_ext.ridge.batched_cholesky(A)`` vs ``torch.linalg.cholesky(A)``,
``solve`` is ``batched_cholesky_solve(L, B)`` vs ``torch.cholesky_solve(B, L)``, and
``cholesky+solve`` both, and ``fused cholesky+solve`` is ``batched_spd_solve(A, B)`` (factor kept in cache)
vs the same torch pair. Grouped per (shape, op), so the table compares ours and torch side by side.

Outputs above glibc's 32 MB mmap threshold (4096×64×64 and 512×128×128 fp32) come from fresh
mmap'd memory on every call, so each such call pays for faulting its pages in, as much for torch as
for us; ``alloc_floor`` in the ``cholesky`` groups times just that (``torch.empty_like(A).fill_(0)``).
``THP_MEM_ALLOC_ENABLE=1`` (PyTorch's huge-page allocation) makes it smaller. Threads: PyTorch's
setting (default: all cores).

Run: ``python -m pytest bench/test_cholesky_bench.py --benchmark-only``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("pytest_benchmark")

from attn_ext._extension import extension_error  # noqa: E402 - after the plugin check
from attn_ext.ridge import batched_cholesky, batched_cholesky_solve, batched_spd_solve  # noqa: E402

SHAPES = ((4096, 64), (4096, 32), (512, 128))  # (batch, n); r = n
OPS = ("cholesky", "solve", "cholesky+solve", "fused cholesky+solve")  # torch has no fused form: its pair
IMPLS = ("ours", "torch")


# Module scope + params: each shape's inputs (up to 64 MB per tensor) are built once.
@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"{s[0]}x{s[1]}x{s[1]}")
def problem(request: pytest.FixtureRequest):
    batch, n = request.param
    g = torch.Generator().manual_seed(0)
    z = torch.randn(batch, n, n, generator=g)
    a = z @ z.mT / n + torch.eye(n)
    b = torch.randn(batch, n, n, generator=g)
    return batch, n, a, b, torch.linalg.cholesky(a)


def make_call(impl: str, op: str, a, b, l):
    if impl == "ours":
        calls = {"cholesky": lambda: batched_cholesky(a),
                 "solve": lambda: batched_cholesky_solve(l, b),
                 "cholesky+solve": lambda: batched_cholesky_solve(batched_cholesky(a)[0], b),
                 "fused cholesky+solve": lambda: batched_spd_solve(a, b)}
    else:
        calls = {"cholesky": lambda: torch.linalg.cholesky(a),
                 "solve": lambda: torch.cholesky_solve(b, l),
                 "cholesky+solve": lambda: torch.cholesky_solve(b, torch.linalg.cholesky(a)),
                 "fused cholesky+solve": lambda: torch.cholesky_solve(b, torch.linalg.cholesky(a))}
    return calls[op]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("impl", IMPLS)
def test_batched_cholesky(benchmark, request: pytest.FixtureRequest, problem, impl: str, op: str):
    batch, n, a, b, l = problem
    if impl == "ours" and extension_error():
        pytest.skip(extension_error())
    benchmark.group = f"cholesky {batch}x{n}x{n} r={n} {op}"
    benchmark.extra_info.update(batch=batch, n=n, r=n, impl=impl, op=op, dtype="float32",
                                threads=torch.get_num_threads())
    rounds = max(request.config.getoption("--bench-rounds"), 5)
    benchmark.pedantic(make_call(impl, op, a, b, l), rounds=rounds, warmup_rounds=1, iterations=1)


def test_output_allocation_floor(benchmark, request: pytest.FixtureRequest, problem):
    """What allocating and touching one output of A's size costs, whoever computes it."""
    batch, n, a, _, _ = problem
    benchmark.group = f"cholesky {batch}x{n}x{n} r={n} cholesky"
    benchmark.extra_info.update(batch=batch, n=n, impl="alloc_floor", op="empty_like+fill_", dtype="float32",
                                threads=torch.get_num_threads())
    rounds = max(request.config.getoption("--bench-rounds"), 5)
    benchmark.pedantic(lambda: torch.empty_like(a).fill_(0.0), rounds=rounds, warmup_rounds=1, iterations=1)
