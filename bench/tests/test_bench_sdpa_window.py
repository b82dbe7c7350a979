"""The sdpa_window benchmark's pure parts: registration, the band, the check against SDPA, the goal's verdict
and the report on a run with stand-in timings (no timing is asserted)."""
import json

import pytest
import torch

import bench
import bench.bench_sdpa_window as sw
from bench.harness import BenchOptions, goals


@pytest.fixture(autouse=True)
def _no_waiting(monkeypatch):
    monkeypatch.setattr(goals, "QUIET_WAIT_S", 0.0)
    monkeypatch.setattr(goals, "load_average", lambda: 0.1)


def test_registered_and_run_by_default():
    assert bench.BENCHMARKS["sdpa_window"] == "bench.bench_sdpa_window" and "sdpa_window" in bench.DEFAULT_BENCHMARKS


def test_band_and_check():
    b = sw.band(6, 2)
    assert b[5].tolist() == [False, False, False, True, True, True] and b[0].tolist() == [True] + [False] * 5
    assert sw.check("cpp", length=40, window=5) <= sw.CHECK_ATOL
    assert sw.check("reference", length=40, window=5) <= sw.CHECK_ATOL


@pytest.mark.parametrize("quick", [True, False])
def test_run_judges_the_full_grid_only(quick, monkeypatch, tmp_path):
    ratios = {"fwd": 0.05, "fwd+bwd": 0.2}
    calls = []

    def fake_measure(length, backend, repeats):
        calls.append(length)
        timing = {"median_ms": 1.0, "samples_ms": [1.0]}
        return {p: {"window": timing, "causal": timing, "ratio": r} for p, r in ratios.items()}

    monkeypatch.setattr(sw, "measure", fake_measure)
    monkeypatch.setattr(sw, "check", lambda backend: 1e-6)
    status = sw.run(BenchOptions(quick=quick, out_dir=tmp_path, repeats=1))
    assert status == 0
    result = json.loads((tmp_path / "sdpa_window.json").read_text())
    text = (tmp_path / "sdpa_window.md").read_text()
    if quick:
        assert calls == [sw.QUICK_L] and result["verdicts"] == {} and "not judged" in text
    else:  # fwd+bwd fails and is re-measured once (the same stand-in): NOT met; fwd met
        assert calls == [sw.FULL_L, sw.FULL_L] and result["verdicts"] == {"fwd": "met", "fwd+bwd": "NOT met"}
    assert "window / causal" in text and torch.__version__.split("+")[0] in text
