"""The slowdown task (the Intention paper's Fig. 5): its sampler, its reference, the report's structure.

No assertion here depends on a time: the CLI test checks only what the report holds on a tiny grid.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from bench.__main__ import main
from bench.intention.slowdown import (QUANTILES, RATIOS, nxn_map_intention, quantiles, regime_medians, sample_grid,
                                      summary)


def test_grid_is_log_uniform_in_range_seeded_and_prefix_stable():
    grid = sample_grid(4000, (16, 2048), (8, 256), seed=3)
    ns, ds = [n for n, _ in grid], [d for _, d in grid]
    assert min(ns) >= 16 and max(ns) <= 2048 and min(ds) >= 8 and max(ds) <= 256
    # log2 N uniform on [4, 11]: mean 7.5, sd 7/sqrt(12) ~ 2.0; the fraction below the midpoint ~ 1/2.
    log_n = torch.tensor([math.log2(n) for n in ns])
    assert abs(float(log_n.mean()) - 7.5) < 0.15 and abs(float(log_n.std()) - 7 / 12 ** 0.5) < 0.1
    assert abs(sum(d < 2 ** 5.5 for d in ds) / len(ds) - 0.5) < 0.05
    # N and d are drawn independently: their log-correlation is near 0.
    log_d = torch.tensor([math.log2(d) for d in ds])
    assert abs(float(torch.corrcoef(torch.stack([log_n, log_d]))[0, 1])) < 0.05
    assert sample_grid(10, (16, 2048), (8, 256), seed=3) == grid[:10]
    assert sample_grid(10, (16, 2048), (8, 256), seed=4) != grid[:10]


def test_grid_validates():
    with pytest.raises(ValueError, match="1 <= MIN <= MAX"):
        sample_grid(5, (64, 16), (8, 256), seed=0)
    with pytest.raises(ValueError, match="--samples"):
        sample_grid(0, (16, 64), (8, 256), seed=0)


@pytest.mark.parametrize("n,d", [(50, 6), (4, 9)])
def test_nxn_map_is_the_ridge_prediction(n, d):
    q, k, v = torch.randn(2, 3, 7, d), torch.randn(2, 3, n, d), torch.randn(2, 3, n, 5)
    q64, k64, v64 = q.double(), k.double(), v.double()
    expected = q64 @ torch.linalg.solve(k64.mT @ k64 + 0.5 * torch.eye(d, dtype=torch.float64), k64.mT @ v64)
    torch.testing.assert_close(nxn_map_intention(q, k, v, alpha=0.5).double(), expected, atol=2e-4, rtol=2e-4)


def test_summary_quantiles_and_fractions():
    rows = [{f"{name}_slowdown": x for name in RATIOS} for x in (0.5, 1.0, 2.0, 4.0, 8.0)]
    stats = summary(rows)
    assert set(stats) == set(RATIOS)
    for s in stats.values():
        assert list(s["quantiles"].values()) == quantiles([0.5, 1.0, 2.0, 4.0, 8.0])
        assert s["quantiles"]["0.5"] == 2.0 and s["quantiles"]["0.0"] == 0.5 and s["quantiles"]["1.0"] == 8.0
        assert s["fraction_faster"] == 0.2 and s["fraction_in_paper_range"] == 0.6


def test_regime_medians_split_by_form():
    rows = [{"N": n, "d": d, **{f"{name}_slowdown": x for name in RATIOS}}
            for n, d, x in ((300, 8, 0.1), (300, 16, 0.3), (8, 300, 5.0), (100, 100, 1.0))]
    m = regime_medians(rows)
    assert m["N ≥ d"]["points"] == 3 and m["N ≥ d"]["intention"] == 0.3
    assert m["N < d"]["points"] == 1 and m["N < d"]["sigma_intention"] == 5.0
    assert m["N ≥ 256"]["points"] == 2 and m["N ≥ 256"]["nxn_map"] == pytest.approx(0.2)
    assert regime_medians(rows[:1])["N < d"]["intention"] is None


def test_cli_report_structure(tmp_path, capsys):
    status = main(["intention", "slowdown", "--out", str(tmp_path), "--samples", "3", "--n-range", "8", "32",
                   "--d-range", "4", "16", "--repeats", "1", "--seed", "2"])
    assert status == 0
    stem = tmp_path / "intention_slowdown"
    for suffix in (".md", ".json", ".png"):
        assert stem.with_suffix(suffix).stat().st_size > 0
    result = json.loads(stem.with_suffix(".json").read_text())
    assert [(r["N"], r["d"]) for r in result["rows"]] == sample_grid(3, (8, 32), (4, 16), seed=2)
    for r in result["rows"]:
        for name in RATIOS:
            assert r[f"{name}_slowdown"] == pytest.approx(r[f"{name}_ms"] / r["sdpa_ms"])
    assert set(result["summary"]) == set(RATIOS)
    assert all(len(s["quantiles"]) == len(QUANTILES) for s in result["summary"].values())
    text = stem.with_suffix(".md").read_text()
    assert "Beside the paper" in text and "python -m bench intention slowdown" in text
    assert "| Intention |" in capsys.readouterr().out


def test_cli_rejects_bad_range(tmp_path):
    assert main(["intention", "slowdown", "--out", str(tmp_path), "--n-range", "64", "8"]) == 2
