"""pytest-benchmark suite: attn_ext.cross_attention vs SDPA, forward and forward+backward.

Same workload as ``python -m bench run cross_attention`` (shapes, inputs and calls
come from :mod:`bench.cross_attention_workload`): B=8, H=4, M=128,
D=Dv=64, fp32 on CPU, N in {1e3, 1e4, 1e5} (+3e5 with ``--bench-large``).
Benchmarks are grouped per (N, pass) so pytest-benchmark's table compares
ours and SDPA side by side. Peak memory is measured by the CLI, not here.

Run: ``python -m pytest bench/ --benchmark-only``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_benchmark")

from bench import cross_attention_workload as wl  # noqa: E402 - after the plugin check


@pytest.fixture(scope="session")
def ours_error(backend: str) -> str | None:
    """Why 'ours' cannot run (then its benchmarks skip and SDPA's still run)."""
    error, _ = wl.check_ours(backend)
    return error


# Module scope + params: pytest groups the tests by N, so each N's inputs (1.6 GB
# of K and V at N=1e5) are built once and released before the next N.
@pytest.fixture(scope="module", params=wl.FULL_NS, ids=lambda n: f"N={n}")
def inputs(request: pytest.FixtureRequest):
    n = request.param
    if n not in wl.QUICK_NS and not request.config.getoption("--bench-large"):
        pytest.skip(f"N={n} runs only with --bench-large")
    return n, wl.make_inputs(n)


@pytest.mark.parametrize("pass_", wl.PASSES)
@pytest.mark.parametrize("impl", wl.IMPLS)
def test_cross_attention(
    benchmark, request: pytest.FixtureRequest, inputs, impl: str, pass_: str, backend: str, ours_error: str | None
):
    n, (q, k, v) = inputs
    if impl == "ours" and ours_error:
        pytest.skip(ours_error)
    call = wl.make_call(wl.implementation(impl, backend), pass_, q, k, v)
    benchmark.group = f"cross_attention N={n} {pass_}"
    benchmark.extra_info.update(
        N=n, impl=wl.impl_label(impl, backend), pass_=pass_, flops=wl.flops(n, pass_),
        shape=f"B={wl.B} H={wl.H} M={wl.M} D=Dv={wl.D} fp32",
    )
    rounds = request.config.getoption("--bench-rounds")
    benchmark.pedantic(call, rounds=rounds, warmup_rounds=1, iterations=1)
    stats = getattr(benchmark, "stats", None)
    if stats is not None:  # None under --benchmark-disable
        benchmark.extra_info["gflops_median"] = wl.flops(n, pass_) / stats.stats.median / 1e9
