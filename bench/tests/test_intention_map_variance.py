"""`python -m bench intention map_variance`: the sampler, the three maps against float64 formulas, the CLI."""
import json
import math

import pytest
import torch

from bench.__main__ import main
from bench.intention.map_variance import (FORMS, explicit_inverse_variance, intention_z, measure, sample_keys_queries,
                                          theory_variance)


def test_sampler_draws_standard_normal_queries_and_keys():
    q, k = sample_keys_queries(32, 40, 16, 64, torch.Generator().manual_seed(0))
    assert q.shape == (64, 1, 16, 40) and k.shape == (64, 1, 32, 40) and q.dtype == torch.float64
    for x in (q, k):
        assert abs(float(x.mean())) < 0.02 and abs(float(x.var()) - 1) < 0.02
    assert not torch.equal(q[..., :16, :], k[..., :16, :])
    again = sample_keys_queries(32, 40, 16, 64, torch.Generator().manual_seed(0))
    assert torch.equal(q, again[0]) and torch.equal(k, again[1])
    with pytest.raises(ValueError, match="sample_keys_queries"):
        sample_keys_queries(0, 4, 4, 4, None)


@pytest.mark.parametrize("n_keys, dim", [(8, 3), (8, 8), (8, 20)])
def test_maps_equal_the_papers_formulas_in_float64(n_keys, dim):
    q, k = sample_keys_queries(n_keys, dim, 5, 4, torch.Generator().manual_seed(dim))
    # The paper's Z = Q Kᵀ(KKᵀ)⁻¹, read as the minimum-norm map Q pinv(K) where KKᵀ is singular (d < N).
    pinv = q @ torch.linalg.pinv(k)
    assert torch.allclose(intention_z(q, k, "unscaled"), pinv, atol=1e-9)
    assert torch.allclose(intention_z(q, k, "scaled"), math.sqrt(dim) * pinv, atol=1e-8)
    if dim >= n_keys:
        literal = q @ k.mT @ torch.linalg.inv(k @ k.mT)
        assert torch.allclose(intention_z(q, k, "unscaled"), literal, atol=1e-8)
    # 0.5√d Q Kᵀ[σ(0) KKᵀ + (1 − σ(0)) I]⁻¹, written out with σ(0) = 1/2.
    eye = torch.eye(n_keys, dtype=torch.float64)
    regularised = 0.5 * math.sqrt(dim) * q @ k.mT @ torch.linalg.inv(0.5 * k @ k.mT + 0.5 * eye)
    assert torch.allclose(intention_z(q, k, "regularised"), regularised, atol=1e-9)
    with pytest.raises(ValueError, match="unknown form"):
        intention_z(q, k, "softmax")


def test_theory_is_the_inverse_wishart_mean_and_the_measurement_matches_it():
    assert theory_variance(16, 64, "unscaled") == pytest.approx(1 / 47)
    assert theory_variance(16, 64, "scaled") == pytest.approx(64 / 47)
    assert theory_variance(16, 4, "unscaled") == pytest.approx(4 / (16 * 11))
    assert all(math.isinf(theory_variance(16, d, "unscaled")) for d in (15, 16, 17))
    assert theory_variance(16, 64, "regularised") is None
    rows = measure([8], [2, 40, 200], draws=400, queries=8, seed=0)
    for r in rows:  # away from d ≈ N the pooled variance is within a few percent of the closed form
        for form in ("unscaled", "scaled"):
            assert r[form] == pytest.approx(r[f"{form}_theory"], rel=0.1), (r["d"], form)
    big = rows[-1]
    assert big["scaled"] == pytest.approx(1, abs=0.1) and big["unscaled"] < 0.01
    assert big["regularised"] == pytest.approx(1, abs=0.1)


def test_regulariser_stays_bounded_where_the_scaled_map_diverges():
    rows = measure([16], [15, 16, 17], draws=200, queries=8, seed=1)
    assert max(r["scaled"] for r in rows) > 20
    assert max(r["regularised"] for r in rows) < 2


def test_explicit_inverse_is_rounding_noise_below_n_and_the_map_above():
    q, k = sample_keys_queries(16, 4, 8, 32, torch.Generator().manual_seed(5))
    noise = explicit_inverse_variance(q, k)
    assert noise is None or noise > 100 * float(intention_z(q, k, "unscaled").var())
    q, k = sample_keys_queries(16, 40, 8, 32, torch.Generator().manual_seed(5))
    assert explicit_inverse_variance(q, k) == pytest.approx(float(intention_z(q, k, "unscaled").var()), rel=1e-9)


def test_cli_end_to_end_writes_the_report(tmp_path, capsys):
    code = main(["intention", "map_variance", "--out", str(tmp_path), "--keys", "4", "8", "--dims", "2", "8", "64",
                 "--draws", "16", "--queries", "4"])
    assert code == 0
    result = json.loads((tmp_path / "intention_map_variance.json").read_text())
    assert [(r["N"], r["d"]) for r in result["rows"]] == [(4, 2), (4, 8), (4, 64), (8, 2), (8, 8), (8, 64)]
    assert all(set(FORMS) <= set(r) for r in result["rows"])
    md = (tmp_path / "intention_map_variance.md").read_text()
    assert "Beside the paper" in md and "converges smoothly to 1" in md and "| 8 | 64 |" in md
    assert (tmp_path / "intention_map_variance.png").stat().st_size > 10_000
    assert "scaled + regulariser" in capsys.readouterr().out
    with pytest.raises(ValueError, match="map_variance"):
        main(["intention", "map_variance", "--out", str(tmp_path), "--draws", "1"])
