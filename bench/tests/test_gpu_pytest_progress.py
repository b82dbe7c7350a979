"""The pytest progress record of ``make gpu-check``'s tests and sanitize stages, proven without a GPU.

A synthetic test file runs under pytest with the recording plugin (python_tests/gpu/_progress_plugin.py):
one test passes, one fails, one is skipped, one sleeps and one comes after it. The run is killed while the
sleeper runs, as a stage's time limit would kill it, and bench/gpu/pytest_progress.py must then name the
sleeper as unfinished and the last test as never started; the report of the stage must say so too.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench.gpu import pytest_progress, report

ROOT = Path(__file__).resolve().parents[2]
GPU_TESTS = ROOT / "python_tests" / "gpu"

TESTS = textwrap.dedent("""
    import time
    import pytest

    def test_passes():
        time.sleep(0.3)

    def test_fails():
        assert 1 == 2

    def test_skipped():
        pytest.skip("synthetic skip")

    def test_sleeps():
        time.sleep(60)

    def test_after_the_sleeper():
        pass
""")
# The plugin as the GPU tests' conftest.py registers it, without that conftest's GPU rules.
CONFTEST = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {str(GPU_TESTS)!r})
    from _progress_plugin import register

    def pytest_configure(config):
        register(config)
""")


def _project(tmp_path: Path) -> Path:
    folder = tmp_path / "synthetic"
    folder.mkdir()
    (folder / "conftest.py").write_text(CONFTEST)
    (folder / "test_synthetic.py").write_text(TESTS)
    return folder


def _pytest(folder: Path, record: Path, *options: str) -> subprocess.Popen:
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    env["ATTN_EXT_TEST_PROGRESS"] = str(record)
    return subprocess.Popen([sys.executable, "-m", "pytest", str(folder), "-q", "-p", "no:cacheprovider", *options],
                            cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _started(record: Path) -> set[str]:
    lines = record.read_text().splitlines() if record.exists() else []
    return {f[2].split("::")[-1] for f in (line.split("\t") for line in lines) if len(f) > 2 and f[1] == "start"}


def _killed_run(tmp_path: Path, *options: str) -> Path:
    """The synthetic run, killed (SIGKILL, as `timeout -k` ends) once the sleeper has started."""
    record = tmp_path / "tests.progress"
    process = _pytest(_project(tmp_path), record, *options)
    deadline = time.monotonic() + 60
    try:
        while "test_sleeps" not in _started(record):
            assert process.poll() is None, f"pytest ended before the sleeper started:\n{process.communicate()[0]}"
            assert time.monotonic() < deadline, "the sleeper never started"
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
    return record


def _ids(ids: list[str]) -> list[str]:
    return [nodeid.split("::")[-1] for nodeid in ids]


def test_a_killed_run_names_its_unfinished_and_never_started_tests(tmp_path):
    progress = pytest_progress.read(_killed_run(tmp_path))
    assert _ids(progress.collected) == ["test_passes", "test_fails", "test_skipped", "test_sleeps",
                                        "test_after_the_sleeper"]
    assert _ids(progress.unfinished()) == ["test_sleeps"]
    assert _ids(progress.never_started()) == ["test_after_the_sleeper"]
    assert {_ids([n])[0]: progress.outcome[n] for n in progress.finished} == {
        "test_passes": "passed", "test_fails": "failed", "test_skipped": "skipped"}
    assert progress.exit_status is None
    passes = next(n for n in progress.finished if n.endswith("test_passes"))
    assert progress.seconds[passes] >= 0.3

    lines = pytest_progress.summary_lines(progress, "tests.progress")
    text = "\n".join(lines)
    assert lines[0].startswith("tests.progress: 5 collected, 3 finished (1 passed, 1 failed, 1 skipped), "
                               "1 unfinished, 1 never started; pytest did not end")
    unfinished = lines.index(next(line for line in lines if line.startswith("unfinished")))
    assert "::test_sleeps (started at +" in lines[unfinished + 1]
    assert "never started (1):" in text and "::test_after_the_sleeper" in text
    slowest = lines[lines.index(next(line for line in lines if line.startswith("slowest"))) + 1]
    assert slowest.endswith("::test_passes")  # the slowest of the finished ones comes first


def test_a_whole_run_records_its_end(tmp_path):
    folder = _project(tmp_path)
    (folder / "test_synthetic.py").write_text(TESTS.replace("time.sleep(60)", "pass"))
    record = tmp_path / "tests.progress"
    output = _pytest(folder, record).communicate(timeout=120)[0]
    progress = pytest_progress.read(record)
    assert progress.exit_status == "1", output  # 1: a test failed
    assert progress.unfinished() == [] and progress.never_started() == []
    assert len(progress.finished) == 5
    assert "pytest ended (exit status 1)" in pytest_progress.summary_lines(progress, "tests.progress")[0]


def test_a_run_that_stops_itself_counts_the_rest_without_listing_them(tmp_path):
    # -x (or --maxfail): pytest chose not to run the rest, which its own log explains.
    record = tmp_path / "tests.progress"
    _pytest(_project(tmp_path), record, "-x").communicate(timeout=120)
    progress = pytest_progress.read(record)
    assert progress.exit_status == "1"
    assert _ids(progress.never_started()) == ["test_skipped", "test_sleeps", "test_after_the_sleeper"]
    lines = pytest_progress.summary_lines(progress, "tests.progress")
    assert "never started: 3 (pytest stopped before them)" in lines
    assert not any(line.endswith("::test_sleeps") for line in lines)


def test_the_plugin_records_nothing_without_its_variable(tmp_path):
    folder = _project(tmp_path)
    (folder / "test_synthetic.py").write_text("def test_one():\n    pass\n")
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PYTEST_", "ATTN_EXT_TEST_PROGRESS"))}
    done = subprocess.run([sys.executable, "-m", "pytest", str(folder), "-q", "-p", "no:cacheprovider"], cwd=folder,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [p.name for p in tmp_path.rglob("*.progress")] == []


def test_under_xdist_the_controller_records_each_event_once(tmp_path):
    pytest.importorskip("xdist", reason="pytest-xdist is not installed: the tests stage's -n run is not tested here")
    progress = pytest_progress.read(_killed_run(tmp_path, "-n", "2"))
    assert sorted(_ids(progress.collected)) == sorted(["test_passes", "test_fails", "test_skipped", "test_sleeps",
                                                       "test_after_the_sleeper"])
    assert "test_sleeps" in _ids(progress.unfinished()) and "test_sleeps" not in _ids(progress.finished)
    starts = [line for line in (tmp_path / "tests.progress").read_text().splitlines() if "\tstart\t" in line]
    assert len(starts) == len(set(line.split("\t")[2] for line in starts))  # once, not once per process
    # Which tests the other worker finished before the kill is up to xdist's scheduling; each is right.
    expected = {"test_passes": "passed", "test_fails": "failed", "test_skipped": "skipped",
                "test_after_the_sleeper": "passed"}
    assert {_ids([n])[0]: progress.outcome[n] for n in progress.finished}.items() <= expected.items()


def test_the_report_shows_the_unfinished_tests_of_a_stopped_stage(tmp_path):
    record = _killed_run(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    record.rename(work / "tests.progress")
    (work / "sanitize-memcheck.progress").write_text(
        "1.0\tcollected\tgpu/test_x.py::test_y[cuda]\n2.0\tstart\tgpu/test_x.py::test_y[cuda]\n")
    (work / "stages.tsv").write_text("tests\tTIMEOUT\t170\tstopped at its limit of 170 s\t2026-01-01T00:00:00Z\tabc\n"
                                     "sanitize\tTIMEOUT\t90\tstopped\t2026-01-01T00:01:00Z\tabc\n")
    (work / "tests.log").write_text("....\n")
    markdown, _ = report.render(work, ["tests", "sanitize"], None)
    tests = markdown[markdown.index("## tests"):markdown.index("## sanitize")]
    assert "tests.progress: 5 collected, 3 finished" in tests and "::test_sleeps (started at +" in tests
    assert "::test_after_the_sleeper" in tests and "slowest 3 finished tests" in tests
    sanitize = markdown[markdown.index("## sanitize"):]
    assert "sanitize-memcheck.progress: 1 collected, 0 finished" in sanitize
    assert "gpu/test_x.py::test_y[cuda] (started at +1.0 s)" in sanitize
