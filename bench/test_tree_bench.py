"""pytest-benchmark suite: Tree Cross Attention vs full cross attention over all tokens.

Same workload as ``python -m bench run tree_attention`` (shapes, inputs and calls come
from :mod:`bench.bench_tree_attention`): B=1, H=4, M=1024 queries, D=Dv=64,
fp32 on CPU, N in {1e4, 1e5} tokens, b=2. ``tree`` is greedy
``tree_cross_attention`` over the aggregated nodes, ``full`` is
``ae.cross_attention`` over all N tokens, ``build_aggregate`` is ``build_tree``
then ``tree_aggregate`` of the keys and of the values. Grouped per N. The CLI
also covers N = 1e3 and 1e6 and b = 4, 16.

Run: ``python -m pytest bench/test_tree_bench.py --benchmark-only``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_benchmark")

import bench.bench_tree_attention as ta  # noqa: E402 - after the plugin check
from bench.cross_attention_workload import check_ours  # noqa: E402

NS = (10_000, 100_000)
BRANCHING = 2
#: The tree op takes milliseconds: several calls per round (pytest-benchmark divides).
TREE_ITERATIONS = 5


# Module scope + params: each N's tensors are built once and released before the next N.
@pytest.fixture(scope="module", params=NS, ids=lambda n: f"N={n}")
def problem(request: pytest.FixtureRequest, backend: str):
    error, _ = check_ours(backend)
    if error:
        pytest.skip(error)
    n = request.param
    q, points, leaf_k, leaf_v = ta.make_problem(n)
    tree, node_k, node_v = ta.build_and_aggregate(points, leaf_k, leaf_v, BRANCHING)
    k_leaves, v_leaves = ta.heads(leaf_k, ta.D).contiguous(), ta.heads(leaf_v, ta.DV).contiguous()
    return n, q, points, leaf_k, leaf_v, tree, node_k, node_v, k_leaves, v_leaves


@pytest.mark.parametrize("op", ("tree", "full", "build_aggregate"))
def test_tree_attention(benchmark, request: pytest.FixtureRequest, problem, op: str, backend: str):
    n, q, points, leaf_k, leaf_v, tree, node_k, node_v, k_leaves, v_leaves = problem
    if op == "tree":
        call, iterations = ta.tree_call(q, node_k, node_v, tree, backend), TREE_ITERATIONS
    elif op == "full":
        call, iterations = ta.full_call(q, k_leaves, v_leaves, backend), 1
    else:
        call, iterations = (lambda: ta.build_and_aggregate(points, leaf_k, leaf_v, BRANCHING)), 1
    benchmark.group = f"tree_attention N={n}"
    benchmark.extra_info.update(
        N=n, op=op, branching=BRANCHING, backend=backend, num_selected=tree.num_selected,
        shape=f"B={ta.B} H={ta.H} M={ta.M} D=Dv={ta.D} fp32",
    )
    rounds = max(request.config.getoption("--bench-rounds"), 5 if op == "tree" else 3)
    benchmark.pedantic(call, rounds=rounds, warmup_rounds=1, iterations=iterations)
