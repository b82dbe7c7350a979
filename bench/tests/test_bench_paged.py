"""The paged benchmark's pure parts: the paged and contiguous caches hold the same keys, and a run's report with
stand-in timings (no timing is asserted)."""
import json

import pytest
import torch

import bench
import bench.bench_paged as bp
from bench.harness import BenchOptions, goals


@pytest.fixture(autouse=True)
def _no_waiting(monkeypatch):
    monkeypatch.setattr(goals, "QUIET_WAIT_S", 0.0)
    monkeypatch.setattr(goals, "load_average", lambda: 0.1)


def test_registered_and_run_by_default():
    assert bench.BENCHMARKS["paged"] == "bench.bench_paged" and "paged" in bench.DEFAULT_BENCHMARKS


def test_the_two_layouts_hold_the_same_keys(monkeypatch):
    monkeypatch.setattr(bp, "L", 64)
    q, k_cache, v_cache, table, lengths, k, v = bp.problem(16)
    assert table.shape == (bp.B, 4) and (lengths == 64).all()
    assert torch.equal(k[1, :, 20], k_cache[int(table[1, 1]), 4]) and torch.equal(v[3, :, 63], v_cache[int(table[3, 3]), 15])


def test_run_reports_each_block_size(monkeypatch, tmp_path):
    timing = {"median_ms": 1.0, "samples_ms": [1.0]}
    monkeypatch.setattr(bp, "measure", lambda bs, backend, repeats: {
        "block_size": bs, "paged": timing, "contiguous": timing, "ratio": 0.5 if bs == 256 else 2.0, "max_diff": 0.0})
    assert bp.run(BenchOptions(out_dir=tmp_path, repeats=1)) == 0
    rows = json.loads((tmp_path / "paged.json").read_text())["rows"]
    assert [r["verdict"] for r in rows] == ["NOT met", "met"]
