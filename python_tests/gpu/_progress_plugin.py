"""A pytest plugin that records a run's progress, one line per event, so that a run stopped at a time
limit still says which tests had finished, how long each took, and which had started but not finished.

``make gpu-check`` stops its tests and sanitize stages with a signal at their time limit; a killed pytest
prints no summary and writes no JUnit XML. This plugin appends each event to the file named by
``ATTN_EXT_TEST_PROGRESS`` as it happens (line-buffered, so what was written survives a kill), and
``bench/gpu/pytest_progress.py`` turns the file into the report's lines. Registered by conftest.py here.

Under pytest-xdist the controller sees every worker's events (xdist replays them through the same hooks),
so only the controller writes; a worker would write each event a second time. The collected test ids
come from ``pytest_collection_finish`` in a plain run, from xdist's ``pytest_xdist_node_collection_finished``
(first worker only: every worker collects the same ids) under xdist.

Record format: tab-separated fields, the first the wall-clock time (seconds since the epoch):

    <time>  plugins     <name-version, ...>
    <time>  collected   <nodeid>
    <time>  collect-error <nodeid>
    <time>  start       <nodeid>
    <time>  report      <nodeid>  <setup|call|teardown>  <passed|failed|skipped>  <seconds>
    <time>  finish      <nodeid>
    <time>  end         <pytest's exit status>
"""
from __future__ import annotations

import os
import time

import pytest

#: The environment variable naming the record file; nothing is recorded without it.
ENV = "ATTN_EXT_TEST_PROGRESS"


def _clean(text: str) -> str:
    # A parametrised id may hold any character; a tab or newline would break the line format.
    return text.replace("\t", " ").replace("\n", " ")


class ProgressRecord:
    """Appends one line per test event to ``path`` (opened once, line-buffered)."""

    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1, encoding="utf-8")
        self._collected = False

    def _write(self, *fields: object) -> None:
        self._file.write("\t".join([f"{time.time():.3f}", *(_clean(str(f)) for f in fields)]) + "\n")

    def _write_collected(self, nodeids) -> None:
        if not self._collected:  # under xdist: once, not once per worker
            self._collected = True
            for nodeid in nodeids:
                self._write("collected", nodeid)

    def pytest_configure(self, config: pytest.Config) -> None:
        # Which plugins ran (pytest-timeout? pytest-benchmark?): the report of a lent machine says so.
        plugins = {f"{dist.project_name}-{dist.version}" for _, dist in config.pluginmanager.list_plugin_distinfo()}
        self._write("plugins", ", ".join(sorted(plugins)) or "none")

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if session.items:  # empty on the xdist controller, which collects nothing itself
            self._write_collected(item.nodeid for item in session.items)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        self._write_collected(ids)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self._write("collect-error", report.nodeid)

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self._write("start", nodeid)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._write("report", report.nodeid, report.when, report.outcome, f"{report.duration:.3f}")

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        self._write("finish", nodeid)

    def pytest_sessionfinish(self, exitstatus: int) -> None:
        self._write("end", int(exitstatus))
        self._file.close()


def register(config: pytest.Config) -> None:
    """Records the run to ``$ATTN_EXT_TEST_PROGRESS`` when set, from the process that sees every event."""
    path = os.environ.get(ENV)
    if path and not hasattr(config, "workerinput"):  # workerinput: this is an xdist worker
        config.pluginmanager.register(ProgressRecord(path), "attn_ext_progress_record")
