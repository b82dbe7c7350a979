"""The least-squares scaling task (the Intention paper's Fig. 3): its data, its models, its command line."""
from __future__ import annotations

import json

import pytest
import torch

from bench.__main__ import main
from bench.intention.least_squares import needed_latent
from bench.intention.least_squares_models import (REGRESSORS, build_regressor, evaluate, least_squares_batch,
                                                  train_regressor)


def test_batch_statistics_and_exact_linearity():
    x, y, w = least_squares_batch(4000, 3, generator=torch.Generator().manual_seed(0))
    assert x.shape == (4000, 10, 3) and y.shape == (4000, 10, 1) and w.shape == (4000, 3)
    # W and x are standard normal: mean 0, covariance I (4000 and 40000 draws: 4-5 standard errors).
    assert w.mean(0).abs().max() < 0.07 and (w.T @ w / 4000 - torch.eye(3)).abs().max() < 0.08
    flat = x.reshape(-1, 3)
    assert flat.mean(0).abs().max() < 0.03 and (flat.T @ flat / flat.shape[0] - torch.eye(3)).abs().max() < 0.03
    # Noiseless: least squares on the ten points recovers W (float64 formula).
    x64, y64 = x.double(), y.double()
    solved = torch.linalg.solve(x64.mT @ x64, x64.mT @ y64).squeeze(-1)
    torch.testing.assert_close(solved, w.double(), atol=1e-4, rtol=1e-4)


def test_batch_is_seeded_and_validates():
    a = least_squares_batch(3, 2, generator=torch.Generator().manual_seed(5))
    b = least_squares_batch(3, 2, generator=torch.Generator().manual_seed(5))
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    with pytest.raises(ValueError, match="least_squares_batch"):
        least_squares_batch(0, 2)


@pytest.mark.parametrize("name", list(REGRESSORS))
def test_models_shapes_and_bad_inputs(name):
    model = build_regressor(name, dim=3, latent=4)
    x, y, _ = least_squares_batch(5, 3)
    assert model(x, y).shape == (5, 3)
    with pytest.raises(ValueError, match=type(model).__name__):
        model(x, y[..., :0])
    with pytest.raises(ValueError, match="Regressor"):
        model(x[..., :2], y)


def test_unknown_model_raises():
    with pytest.raises(ValueError, match="unknown least-squares model"):
        build_regressor("transformer", 2, 4)


def test_intention_model_reads_the_ridge_map():
    """With identity embeddings and decoder, the model's map is the ridge solution of the raw data."""
    model = build_regressor("intention", dim=2, latent=3)
    x, y, w = least_squares_batch(4, 2, generator=torch.Generator().manual_seed(1))
    xy = torch.cat([x, y], -1)
    with torch.no_grad():
        for e in (model.e_k, model.e_v):   # two Linear layers with a ReLU between: identity on positive inputs
            for layer in (e[0], e[2]):
                layer.weight.copy_(torch.eye(3))
                layer.bias.zero_()
    shift = 10.0   # keeps every input positive, so the ReLU passes it unchanged
    k = (xy + shift).double()
    alpha = torch.nn.functional.softplus(model.raw_alpha).double()
    expected = torch.linalg.solve(k.mT @ k + alpha * torch.eye(3, dtype=torch.float64), k.mT @ k)
    captured = {}
    model.e_p.register_forward_pre_hook(lambda _m, inp: captured.setdefault("w", inp[0]))
    model(x + shift, y + shift)
    torch.testing.assert_close(captured["w"].double().view(4, 3, 3), expected, atol=2e-3, rtol=2e-3)


def test_short_training_lowers_the_loss():
    torch.manual_seed(0)
    model = build_regressor("intention", dim=2, latent=8)
    eval_set = least_squares_batch(256, 2, generator=torch.Generator().manual_seed(9))
    before = evaluate(model, eval_set)
    result = train_regressor(model, 2, steps=150, batch=32, lr=3e-3, eval_set=eval_set,
                             generator=torch.Generator().manual_seed(3))
    assert result["eval_mse"] < 0.5 * before and result["last_loss"] < 0.5 * result["first_loss"]


def test_needed_latent_picks_the_first_reached():
    rows = [{"model": "a", "d": 2, "latent": 2, "reached": False}, {"model": "a", "d": 2, "latent": 4, "reached": True},
            {"model": "b", "d": 2, "latent": 2, "reached": False}]
    assert needed_latent(rows, "a", 2) == 4 and needed_latent(rows, "b", 2) is None


def test_cli_end_to_end(tmp_path, capsys):
    status = main(["intention", "least_squares", "--out", str(tmp_path), "--dims", "2", "--latents", "2", "4",
                   "--steps", "3", "--batch", "8", "--eval-tasks", "16", "--models", "intention", "mlp"])
    assert status == 0
    stem = tmp_path / "intention_least_squares"
    for suffix in (".md", ".json", ".png"):
        assert stem.with_suffix(suffix).stat().st_size > 0
    result = json.loads(stem.with_suffix(".json").read_text())
    assert result["config"]["models"] == ["intention", "mlp"] and result["config"]["steps"] == 3
    # Each (model, d) tries sizes in order and stops at the first that reaches the threshold.
    for model in ("intention", "mlp"):
        tried = [r for r in result["rows"] if r["model"] == model]
        assert [r["latent"] for r in tried] == [2, 4][:len(tried)]
        assert all(not r["reached"] for r in tried[:-1])
    text = stem.with_suffix(".md").read_text()
    assert "Beside the paper" in text and "python -m bench intention least_squares" in text
    assert "| d | intention | mlp |" in capsys.readouterr().out


def test_cli_rejects_unknown_model(tmp_path):
    assert main(["intention", "least_squares", "--out", str(tmp_path), "--models", "nope"]) == 2
