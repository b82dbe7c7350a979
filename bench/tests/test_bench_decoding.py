"""The decoding benchmark's pure parts: the busy-thread count and a run's report with stand-in timings (no timing
is asserted)."""
import json

import pytest

import bench
import bench.bench_decoding as bd
from bench.harness import BenchOptions, goals


@pytest.fixture(autouse=True)
def _no_waiting(monkeypatch):
    monkeypatch.setattr(goals, "QUIET_WAIT_S", 0.0)
    monkeypatch.setattr(goals, "load_average", lambda: 0.1)


def test_registered_and_run_by_default():
    assert bench.BENCHMARKS["decoding"] == "bench.bench_decoding" and "decoding" in bench.DEFAULT_BENCHMARKS


def test_busy_threads_of_an_idle_wait_is_near_zero():
    import time

    assert bd.busy_threads(lambda: time.sleep(0.02), calls=2) < 0.5


@pytest.mark.parametrize("quick", [True, False])
def test_run_judges_the_full_grid_only(quick, monkeypatch, tmp_path):
    timing = {"median_ms": 3.0, "samples_ms": [3.0]}
    seen = []

    def fake(n, backend, repeats):
        seen.append(n)
        return {"n": n, "ours": timing, "sdpa": timing, "ratio": 0.5, "busy_threads": 1.9, "max_diff": 1e-7}

    monkeypatch.setattr(bd, "measure", fake)
    assert bd.run(BenchOptions(quick=quick, out_dir=tmp_path, repeats=1)) == 0
    result = json.loads((tmp_path / "decoding.json").read_text())
    assert seen == [bd.QUICK_N if quick else bd.FULL_N]
    assert result["verdict"] == ("not judged" if quick else "met")
    assert "0.50x" in (tmp_path / "decoding.md").read_text()
