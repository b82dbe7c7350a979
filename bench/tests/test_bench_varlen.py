"""The varlen benchmark's pure parts: the packed and padded batches hold the same rows, and a run's report (with
stand-in timings; no timing is asserted)."""
import json

import torch

import bench
import bench.bench_varlen as bv
from bench.harness import BenchOptions


def test_registered_and_run_by_default():
    assert bench.BENCHMARKS["varlen"] == "bench.bench_varlen" and "varlen" in bench.DEFAULT_BENCHMARKS


def test_packed_and_padded_batches_hold_the_same_rows():
    lengths, cu, packed, padded, mask = bv.batch(3, 20)
    assert len(lengths) == bv.B and cu[-1] == sum(lengths) and mask.shape == (bv.B, 1, 1, max(lengths))
    for b in (0, bv.B - 1):
        n, start = lengths[b], int(cu[b])
        assert torch.equal(padded[0][b, :, :n], packed[0][start:start + n].transpose(0, 1))
        assert mask[b, 0, 0].sum() == n and (padded[1][b, :, n:] == 0).all()


def test_run_reports_the_ratio(monkeypatch, tmp_path):
    timing = {"median_ms": 2.0, "samples_ms": [2.0]}
    monkeypatch.setattr(bv, "measure", lambda low, high, backend, repeats: {
        "lengths": [3], "varlen": timing, "sdpa_padded": timing, "ratio": 1.0, "padding_share": 0.5})
    assert bv.run(BenchOptions(out_dir=tmp_path, repeats=1)) == 0
    text = (tmp_path / "varlen.md").read_text()
    assert "NOT met" in text and "1.00x" in text and json.loads((tmp_path / "varlen.json").read_text())["rows"]
