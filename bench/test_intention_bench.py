"""pytest-benchmark suite: Intention and σIntention vs SDPA, and the batched Cholesky ops vs torch.

Same workload as ``python -m bench run intention`` (shapes, inputs and calls come from
:mod:`bench.bench_intention`): B=8, H=4, M=N queries and keys, D=Dv=64, fp32 on
CPU, forward of ``ae.intention`` (primal, alpha=1), ``ae.sigma_intention`` (alpha=1)
and SDPA at N in {256, 1024}, grouped per N; and the Cholesky factorisation + solve
of ``[4096, 64, 64]`` SPD matrices with 64 right-hand sides,
``torch.ops.attn_ext.batched_cholesky`` / ``batched_cholesky_solve`` ("ours", skipped
with the reason while the ops are not built) vs ``torch.linalg.cholesky`` /
``torch.cholesky_solve``. The CLI also covers N = 4096, forward+backward and more
Cholesky shapes.

Run: ``python -m pytest bench/test_intention_bench.py --benchmark-only``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_benchmark")

from bench import bench_batched_cholesky as cw  # noqa: E402 - after the plugin check
from bench import bench_intention as attention_bench  # noqa: E402
from bench.cross_attention_workload import check_ours, make_call  # noqa: E402

NS = (256, 1024)
CHOL_BATCH, CHOL_N = cw.CHOL_GOAL_SHAPE


# Module scope + params: each N's tensors are built once and released before the next N.
@pytest.fixture(scope="module", params=NS, ids=lambda n: f"N={n}")
def inputs(request: pytest.FixtureRequest):
    return request.param, attention_bench.make_inputs(request.param)


@pytest.mark.parametrize("impl", attention_bench.IMPLS)
def test_intention(benchmark, request: pytest.FixtureRequest, inputs, impl: str, backend: str):
    n, (q, k, v) = inputs
    if impl != "sdpa":
        error, _ = check_ours(backend)  # σIntention runs ae.cross_attention
        if error:
            pytest.skip(error)
    call = make_call(attention_bench.implementation(impl, backend), "fwd", q, k, v)
    benchmark.group = f"intention fwd N={n}"
    benchmark.extra_info.update(N=n, impl=impl, backend=backend, alpha=attention_bench.ALPHA,
                                shape=f"B={attention_bench.B} H={attention_bench.H} M=N D=Dv={attention_bench.D} fp32")
    rounds = max(request.config.getoption("--bench-rounds"), 5)
    benchmark.pedantic(call, rounds=rounds, warmup_rounds=1, iterations=attention_bench.number_of_calls(n))


@pytest.fixture(scope="module")
def spd():
    return cw.make_spd(CHOL_BATCH, CHOL_N)


@pytest.mark.parametrize("impl", ("ours", "torch"))
def test_cholesky(benchmark, request: pytest.FixtureRequest, spd, impl: str):
    ops = None
    if impl == "ours":
        ops = cw.cholesky_ops()
        if ops is None:
            pytest.skip("torch.ops.attn_ext.batched_cholesky / batched_cholesky_solve not built")
    a, b = spd
    call = cw.cholesky_calls(a, b, ops)[impl]
    benchmark.group = f"cholesky + solve [{CHOL_BATCH}, {CHOL_N}, {CHOL_N}]"
    benchmark.extra_info.update(impl=impl, batch=CHOL_BATCH, n=CHOL_N, rhs=cw.CHOL_RHS, dtype="fp32")
    rounds = max(request.config.getoption("--bench-rounds"), 3)
    benchmark.pedantic(call, rounds=rounds, warmup_rounds=1, iterations=1)
