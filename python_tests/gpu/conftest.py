"""The GPU tests: with ``ATTN_EXT_REQUIRE_GPU=1`` (set by ``make gpu-check``) a skipped test fails.

On a machine without a GPU these tests skip with the reason (``pytest -rs``). On the GPU machine that
``make gpu-check`` runs on, a skip would mean that a backend could not run (a build without its CUDA
part, Triton left in the interpreter, ...), and a check that quietly tested nothing must not pass.

With ``ATTN_EXT_TEST_PROGRESS=<file>`` (set by ``make gpu-check``) the run's progress goes to that file as
it happens (_progress_plugin.py), so that a run stopped at its time limit still names its unfinished tests.
"""
import os

import pytest

from _progress_plugin import register as register_progress_record


def pytest_configure(config):
    register_progress_record(config)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("ATTN_EXT_REQUIRE_GPU") == "1" and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped, but ATTN_EXT_REQUIRE_GPU=1 requires every GPU test to run: {reason}"
