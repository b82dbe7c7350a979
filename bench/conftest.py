"""pytest configuration of the benchmark suite (``pytest bench/ --benchmark-only``).

This directory is outside ``python_tests/``, so ``pytest python_tests`` never
collects it; every item here also gets the ``bench`` marker, so a run over the
whole tree can drop it with ``-m "not bench"``.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attn_ext benchmarks")
    group.addoption("--attn-ext-backend", default="cpp",
                    help="attn_ext backend to benchmark as 'ours' (default: cpp)")
    group.addoption("--bench-large", action="store_true",
                    help="also run N=300000 (needs ~10 GB RAM and several minutes)")
    group.addoption("--bench-rounds", type=int, default=3,
                    help="timed rounds per benchmark after one warm-up (default: 3)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "bench: attn_ext performance benchmark (pytest-benchmark)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.bench)


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> str:
    """The attn_ext backend measured as "ours" (``--attn-ext-backend``)."""
    return request.config.getoption("--attn-ext-backend")
