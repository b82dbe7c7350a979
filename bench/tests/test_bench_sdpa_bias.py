"""The sdpa_bias benchmark's pure parts: registration, the check against SDPA's math path, the goals' verdicts and
the report on a run with stand-in timings and memory (no timing is asserted)."""
import json

import pytest
import torch

import bench
import bench.bench_sdpa_bias as sb
from bench.harness import BenchOptions, goals


@pytest.fixture(autouse=True)
def _no_waiting(monkeypatch):
    monkeypatch.setattr(goals, "QUIET_WAIT_S", 0.0)
    monkeypatch.setattr(goals, "load_average", lambda: 0.1)


def test_registered_and_run_by_default():
    assert bench.BENCHMARKS["sdpa_bias"] == "bench.bench_sdpa_bias" and "sdpa_bias" in bench.DEFAULT_BENCHMARKS


def test_the_four_gradients_match_sdpa_math():
    assert sb.check(length=48) <= sb.CHECK_ATOL


@pytest.mark.parametrize("quick", [True, False])
def test_run_judges_the_full_grid_only(quick, monkeypatch, tmp_path):
    calls = []

    def fake_measure(length, repeats):
        calls.append(length)
        timing = {"median_ms": 1.0, "samples_ms": [1.0]}
        return {"ours": timing, "sdpa_math": timing, "ratio": 0.8}

    def fake_memory(length):
        full = sb.B * sb.H * length * length * 4 / 1e6
        return {"ours": {"mb": 300.0, "method": "rss", "note": ""}, "sdpa_math": {"mb": 2000.0, "method": "rss",
                                                                                  "note": ""},
                "outputs_mb": 250.0, "full_scores_mb": full, "ours_beyond_mb": 50.0}

    monkeypatch.setattr(sb, "measure", fake_measure)
    monkeypatch.setattr(sb, "memory", fake_memory)
    monkeypatch.setattr(sb, "check", lambda: 1e-6)
    assert sb.run(BenchOptions(quick=quick, out_dir=tmp_path, repeats=1)) == 0
    result = json.loads((tmp_path / "sdpa_bias.json").read_text())
    text = (tmp_path / "sdpa_bias.md").read_text()
    if quick:
        assert calls == [sb.QUICK_L] and result["verdicts"] == {} and "not judged" in text
    else:
        assert calls == [sb.FULL_L] and result["verdicts"] == {"time": "met", "memory": "met"}
    assert "SDPA math" in text and torch.__version__.split("+")[0] in text
