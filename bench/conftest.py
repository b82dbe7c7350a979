"""pytest configuration of ``bench/``: the pytest-benchmark functions of the ``bench_<op>.py`` modules.

Each ``bench_<op>.py`` holds its workload, its ``python -m bench run`` runner and, at the end, its
pytest-benchmark functions, so one op's benchmark lives in one file::

    python -m pytest bench/bench_cross_attention.py --benchmark-only
    python -m pytest bench --benchmark-only -m bench      # every op

pytest's default file pattern is ``test_*.py``, so :func:`pytest_collect_file` collects
``bench/bench_*.py`` too; their items carry the ``bench`` marker (``-m "not bench"`` drops them).
The harness's own tests are ``bench/tests/``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attn_ext benchmarks")
    group.addoption("--attn-ext-backend", default="cpp",
                    help="attn_ext backend to benchmark as 'ours' (default: cpp)")
    group.addoption("--bench-large", action="store_true",
                    help="also run the largest sizes (cross attention N=300000: ~10 GB RAM, several minutes)")
    group.addoption("--bench-rounds", type=int, default=3,
                    help="timed rounds per benchmark after one warm-up (default: 3)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "bench: attn_ext performance benchmark (pytest-benchmark)")


def _is_benchmark_module(path: Path) -> bool:
    return path.suffix == ".py" and path.name.startswith("bench_") and path.parent == HERE


def pytest_collect_file(file_path: Path, parent: pytest.Collector):
    # A file named on the command line is collected by pytest itself, whatever its name.
    if _is_benchmark_module(file_path) and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _is_benchmark_module(Path(item.path)):
            item.add_marker(pytest.mark.bench)
            if not config.pluginmanager.hasplugin("benchmark"):  # pytest-benchmark's plugin name
                item.add_marker(pytest.mark.skip(reason="pytest-benchmark is not installed (the dev extra)"))


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> str:
    """The attn_ext backend measured as "ours" (``--attn-ext-backend``)."""
    return request.config.getoption("--attn-ext-backend")
