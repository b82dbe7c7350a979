"""The GPU tests: with ``ATTN_EXT_REQUIRE_GPU=1`` (set by ``make gpu-check``) a skipped test fails.

On a machine without a GPU these tests skip with the reason (``pytest -rs``). On the GPU machine that
``make gpu-check`` runs on, a skip would mean that a backend could not run (a build without its CUDA
part, Triton left in the interpreter, ...), and a check that quietly tested nothing must not pass.

With ``ATTN_EXT_TEST_PROGRESS=<file>`` (set by ``make gpu-check``) the run's progress goes to that file as
it happens (_progress_plugin.py), so that a run stopped at its time limit still names its unfinished tests.

Under ``ATTN_EXT_TRITON_PIN=1`` Triton's autotuners run their one candidate without timing it
(_pinned_autotuning.py). The tests run longest first (_order.py; in collection order under compute-sanitizer,
``ATTN_EXT_GPU_SANITIZE=1``): the Triton tests that compile fp32 kernels take tens of seconds each, and started
last they decided when a parallel run ended.
"""
import os
import pathlib

import pytest

from _order import longest_first
from _pinned_autotuning import untimed_when_pinned
from _progress_plugin import register as register_progress_record

HERE = pathlib.Path(__file__).resolve().parent


def pytest_configure(config):
    register_progress_record(config)
    untimed_when_pinned()


def pytest_collection_modifyitems(config, items):
    if os.environ.get("ATTN_EXT_GPU_SANITIZE") == "1":
        return  # one process, no workers to balance: the collection order, short tests among the first
    # The hook sees the whole session (the CPU suite collects this folder too): only this folder's tests move,
    # among the places they held.
    places = [i for i, item in enumerate(items) if HERE in pathlib.Path(item.path).parents]
    ours = [items[i] for i in places]
    for place, index in zip(places, longest_first([item.nodeid for item in ours])):
        items[place] = ours[index]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("ATTN_EXT_REQUIRE_GPU") == "1" and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped, but ATTN_EXT_REQUIRE_GPU=1 requires every GPU test to run: {reason}"
