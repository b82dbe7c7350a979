"""The stage control of ``make gpu-check`` (bench/gpu/check.sh), proven without a GPU by its dry run.

``GPU_CHECK_DRY_RUN=1`` replaces every stage by a fake of a tenth of a second; ``GPU_CHECK_DRY_RUN_FAIL`` and
``GPU_CHECK_DRY_RUN_HANG`` make named stages fail or hang. With budgets of seconds these tests check what
a lent GPU machine needs: each stage stops at its limit and the whole run at its deadline, the run keeps
going past a failure (unless told to stop), and the result folder ($OUT) holds at most 8 files with plain
names, rewritten before and after every stage, so that a run killed at any point brings back its report
and an archive of every log written so far.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "check.sh"
DEFAULT_STAGES = ["env", "build", "tests", "sanitize", "bench"]


def _environment(tmp_path: Path, **env: str) -> dict[str, str]:
    environment = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_CHECK_WORK": str(tmp_path / "work"),
                   "PYTHON": sys.executable, "GPU_CHECK_DRY_RUN": "1", **env}
    for name in ("GPU_CHECK_OUT", "GPU_CHECK_KEEP_GOING", "GPU_CHECK_STOP_ON_FAILURE", "GPU_CHECK_DEADLINE"):
        if name not in env:
            environment.pop(name, None)
    return environment


def _run(tmp_path: Path, **env: str) -> tuple[int, str]:
    done = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=_environment(tmp_path, **env), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=60)
    return done.returncode, done.stdout


def _rows(out: Path) -> dict[str, tuple[str, str]]:
    """stage -> (result, note), from the stages.tsv that came back."""
    rows = [line.split("\t") for line in (out / "stages.tsv").read_text().splitlines()]
    return {row[0]: (row[1], row[3]) for row in rows}


def _assert_brought_back(out: Path) -> set[str]:
    """The result folder obeys a lent machine's rules; returns the names in its logs.tar.gz."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 1 <= len(files) <= 8, files
    for path in out.rglob("*"):
        relative = path.relative_to(out)
        assert len(relative.parts) <= 3, relative  # at most 2 folders down
        assert all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in relative.parts), relative
    assert {"report.md", "logs.tar.gz"} <= {p.name for p in files}
    with tarfile.open(out / "logs.tar.gz") as archive:
        return {Path(name).name for name in archive.getnames()}


def _kill_session(session: int) -> None:
    """SIGKILL every process of the session the script leads: each stage's ``timeout`` has a process group of
    its own (so killing the script's group would leave the hanging fake stage running)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session:  # fields after the command: state, ppid, pgrp, session
            try:
                os.kill(int(stat.parent.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_keeps_going_past_a_failure_and_a_stage_at_its_limit(tmp_path):
    started = time.monotonic()
    status, output = _run(tmp_path, GPU_CHECK_DRY_RUN_FAIL="tests", GPU_CHECK_DRY_RUN_HANG="sanitize",
                          GPU_CHECK_BUDGET_SANITIZE="1")
    seconds = time.monotonic() - started
    assert status == 1, output
    out = tmp_path / "out"
    assert _rows(out) == {"env": ("PASS", ""), "build": ("PASS", ""), "tests": ("FAIL", "exit status 1"),
                          "sanitize": ("TIMEOUT", "stopped at its limit of 1 s"), "bench": ("PASS", "")}
    assert 1 <= seconds < 20, output  # the hanging stage was stopped at its 1 s
    names = _assert_brought_back(out)
    assert {f"{stage}.log" for stage in DEFAULT_STAGES} | {"stages.tsv", "env.txt", "bench.md", "report.md"} <= names
    report = (out / "report.md").read_text()
    assert "| tests | **FAIL** |" in report and "| sanitize | **TIMEOUT** |" in report
    assert "| bench | **PASS** |" in report and "dry run: tests fails" in report
    assert not (out / "tests.log").exists()  # the logs stay in the working folder and the archive


def test_stop_on_failure_restores_stopping(tmp_path):
    status, output = _run(tmp_path, GPU_CHECK_DRY_RUN_FAIL="build", GPU_CHECK_STOP_ON_FAILURE="1")
    assert status == 1, output
    rows = _rows(tmp_path / "out")
    assert rows["build"][0] == "FAIL"
    assert {rows[stage][0] for stage in ("tests", "sanitize", "bench")} == {"NOT RUN"}
    assert "GPU_CHECK_STOP_ON_FAILURE=1" in rows["bench"][1]


def test_a_failed_build_skips_only_the_stages_that_need_it(tmp_path):
    status, output = _run(tmp_path, GPU_CHECK_DRY_RUN_FAIL="build")
    assert status == 1, output
    rows = _rows(tmp_path / "out")
    assert rows["env"][0] == "PASS" and rows["build"][0] == "FAIL"
    assert rows["tests"] == ("NOT RUN", "needs the build, which failed")
    assert not (tmp_path / "work" / "tests.log").exists()


def test_the_total_deadline_cuts_the_run_and_the_report_is_there(tmp_path):
    # 10 s in all, 5 of them kept for the last report: tests hangs until the deadline, the rest is not run.
    status, output = _run(tmp_path, GPU_CHECK_DEADLINE="10", GPU_CHECK_DRY_RUN_HANG="tests")
    assert status == 1, output
    out = tmp_path / "out"
    rows = _rows(out)
    assert rows["env"][0] == rows["build"][0] == "PASS" and rows["tests"][0] == "TIMEOUT", rows
    assert rows["sanitize"] == rows["bench"] == ("NOT RUN", "no time left of the 10 s deadline")
    assert "tests.log" in _assert_brought_back(out)
    assert "| tests | **TIMEOUT** |" in (out / "report.md").read_text()


def test_a_run_killed_mid_stage_has_brought_back_everything_before(tmp_path):
    """The device machine's own limit kills the whole command: what is in $OUT then is all that returns."""
    process = subprocess.Popen(["bash", str(SCRIPT)], cwd=ROOT, env=_environment(tmp_path, GPU_CHECK_DRY_RUN_HANG="bench"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "work" / "bench.log").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1)  # the bench stage has started (its row and the report went out just before)
    finally:
        _kill_session(process.pid)
        process.wait()
    out = tmp_path / "out"
    rows = _rows(out)
    assert [rows[stage][0] for stage in DEFAULT_STAGES] == ["PASS", "PASS", "PASS", "PASS", "RUNNING"], rows
    names = _assert_brought_back(out)
    assert {"env.log", "build.log", "tests.log", "sanitize.log"} <= names
    report = (out / "report.md").read_text()
    assert "| sanitize | **PASS** |" in report and "| bench | **RUNNING** |" in report
