"""pytest-benchmark suite: adding 16 keys to an attention state vs recomputing it.

Same workload as ``python -m bench run state_update`` (shapes, inputs and calls come
from :mod:`bench.bench_state_update`): B=1, H=4, M=128, D=Dv=64, fp32 on
CPU, a state over N in {1e4, 1e5} keys; ``update`` is ``ae.update_state`` with
16 new keys, ``recompute`` is ``ae.attention_state`` over all N + 16 keys
(allocated beforehand). Grouped per N, so pytest-benchmark's table compares
the two side by side. The CLI also covers N = 1e3 and 1e6, and 1 thread.

Run: ``python -m pytest bench/test_state_bench.py --benchmark-only``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_benchmark")

from bench import state_update as su  # noqa: E402 - after the plugin check
from bench.cross_attention_workload import check_ours  # noqa: E402

NS = (10_000, 100_000)
#: Calls per round for the update: one call takes ~0.1-0.2 ms, near the timer's and the
#: round loop's own overhead, so a round times several (pytest-benchmark divides).
UPDATE_ITERATIONS = 20


# Module scope + params: each N's keys are built once and released before the next N.
@pytest.fixture(scope="module", params=NS, ids=lambda n: f"N={n}")
def problem(request: pytest.FixtureRequest, backend: str):
    error, _ = check_ours(backend)
    if error:
        pytest.skip(error)
    n = request.param
    q, k_all, v_all = su.make_problem(n)
    state, k_new, v_new = su.initial_state(q, k_all, v_all, backend)
    return n, q, k_all, v_all, state, k_new, v_new


@pytest.mark.parametrize("op", ("update", "recompute"))
def test_state_update(benchmark, request: pytest.FixtureRequest, problem, op: str, backend: str):
    n, q, k_all, v_all, state, k_new, v_new = problem
    if op == "update":
        call, iterations = su.update_call(state, q, k_new, v_new, backend), UPDATE_ITERATIONS
    else:
        call, iterations = su.recompute_call(q, k_all, v_all, backend), 1
    benchmark.group = f"state_update N={n}"
    benchmark.extra_info.update(
        N=n, op=op, new_keys=su.NEW_KEYS, backend=backend,
        shape=f"B={su.B} H={su.H} M={su.M} D=Dv={su.D} fp32",
    )
    # At least 5 rounds: the update is cheap, and its median must survive scheduler hiccups.
    rounds = max(request.config.getoption("--bench-rounds"), 5 if op == "update" else 3)
    benchmark.pedantic(call, rounds=rounds, warmup_rounds=1, iterations=iterations)
