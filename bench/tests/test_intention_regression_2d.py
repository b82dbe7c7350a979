"""`python -m bench intention regression_2d`: the paper's Fig. 4 (untrained computations on 2-D linear regression).

The paper's Fig. 4 applies the computations as they are ("these are not trainable models"), so there
is no training run to test: the data, the four formulas, Pearson's r and the CLI are.
"""
import json

import numpy as np
import pytest

from bench.__main__ import main
from bench.intention import regression_2d as r2d


def test_key_covariance_is_the_absolute_value_of_the_printed_matrix():
    printed = np.array(r2d.PAPER_KEY_MATRIX)
    assert np.linalg.det(printed) < 0  # why a stand-in is needed at all
    cov = r2d.key_covariance()
    np.testing.assert_allclose(cov, cov.T)
    np.testing.assert_allclose(np.sort(np.linalg.eigvalsh(cov)), np.sort(np.abs(np.linalg.eigvalsh(printed))))
    # NumPy's own sampler, handed the printed matrix, draws from this covariance
    with pytest.warns(RuntimeWarning):
        x = np.random.default_rng(1).multivariate_normal(np.zeros(2), printed, size=200_000)
    np.testing.assert_allclose(np.cov(x.T), cov, atol=0.02)


def test_task_statistics():
    many = r2d.sample_task(0, 100_000)
    np.testing.assert_allclose(np.cov(many["keys"].T), r2d.key_covariance(), atol=0.02)
    np.testing.assert_allclose(many["keys"].mean(0), 0.0, atol=0.02)
    np.testing.assert_array_equal(many["values"], many["keys"] @ many["w"])
    ws = np.array([r2d.sample_task(s, 2)["w"] for s in range(4000)])
    np.testing.assert_allclose(ws.var(0), r2d.WEIGHT_VARIANCE, rtol=0.1)
    assert abs(ws.mean()) < 0.15
    with pytest.raises(ValueError, match="num_context"):
        r2d.sample_task(0, 1)


def _softmax(s):
    e = np.exp(s - s.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def test_the_four_computations_match_float64_formulas():
    task = r2d.sample_task(3, 12)
    q, k, v = r2d.query_grid(25.0, 6), task["keys"], task["values"][:, None]
    proj = q @ np.linalg.inv(k.T @ k) @ k.T
    expected = {"Attention": _softmax(q @ k.T) @ v, "Linear Attention": q @ k.T @ v,
                "Intention": proj @ v, "σIntention": _softmax(proj) @ v}
    for method, want in expected.items():
        np.testing.assert_allclose(r2d.predict(method, q, k, task["values"]), want.ravel(), rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="unknown method"):
        r2d.predict("Softmax", q, k, task["values"])


def test_query_grid_covers_the_square():
    g = r2d.query_grid(25.0, 5)
    assert g.shape == (25, 2) and g.min() == -25.0 and g.max() == 25.0
    np.testing.assert_allclose(r2d.query_grid(25.0, 5), 25.0 * r2d.query_grid(1.0, 5))


def test_pearson_and_what_it_says_of_each_method():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=50), rng.normal(size=50)
    assert r2d.pearson(x, 2 * x + y) == pytest.approx(np.corrcoef(x, 2 * x + y)[0, 1], abs=1e-12)
    assert np.isnan(r2d.pearson(x, np.ones(50)))
    with pytest.raises(ValueError, match="pearson"):
        r2d.pearson(x, y[:10])
    ev = r2d.evaluate_task(r2d.sample_task(5, 10), 9)
    # exact least squares on noise-free data, and linear in Q: r = 1 in both regimes
    assert ev["interp"]["r"]["Intention"] == pytest.approx(1.0, abs=1e-9)
    assert ev["extrap"]["r"]["Intention"] == pytest.approx(1.0, abs=1e-9)
    assert ev["interp"]["r"]["Linear Attention"] == pytest.approx(ev["extrap"]["r"]["Linear Attention"], abs=1e-9)


def test_cli_end_to_end(tmp_path):
    code = main(["intention", "regression_2d", "--out", str(tmp_path), "--grid", "7", "--tasks", "3", "--seed", "2"])
    assert code == 0
    result = json.loads((tmp_path / "intention_regression_2d.json").read_text())
    assert result["config"]["tasks"] == 3 and len(result["figure_task"]["truth"]["extrap"]) == 49
    assert set(result["mean_r"]["interp"]) == set(r2d.METHODS)
    md = (tmp_path / "intention_regression_2d.md").read_text()
    assert "| Intention | 1.000 | 1.000 |" in md and "perfectly well" in md and "regression_2d" in md
    assert (tmp_path / "intention_regression_2d.png").stat().st_size > 10_000
