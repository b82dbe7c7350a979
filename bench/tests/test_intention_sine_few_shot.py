"""`python -m bench intention sine_few_shot`: the paper's few-shot sine regression (Figs. 6–7)."""
import argparse
import json
import math

import pytest
import torch

from bench.__main__ import main
from bench.intention import sine_few_shot as sine
from bench.intention.sine_models import SINE_MODELS, build_sine_model


def test_generator_statistics():
    t = sine.sample_sine_tasks(20_000, 50, 10, torch.Generator().manual_seed(0))
    a, b, x, y = t["amplitude"].double(), t["phase"].double(), t["x"].double(), t["y"].double()
    assert 0.1 <= a.min() and a.max() <= 5.0 and 0.0 <= b.min() and b.max() <= math.pi
    assert -6.0 <= x.min() and x.max() < 6.0
    assert a.mean().item() == pytest.approx(2.55, abs=0.03) and a.var().item() == pytest.approx(4.9 ** 2 / 12, rel=0.05)
    assert b.mean().item() == pytest.approx(math.pi / 2, abs=0.03)
    assert x.mean().item() == pytest.approx(0.0, abs=0.02) and x.var().item() == pytest.approx(12.0, rel=0.02)
    torch.testing.assert_close(y, a.view(-1, 1, 1) * torch.sin(x - b.view(-1, 1, 1)), rtol=0, atol=1e-5)
    # E[y²] = E[a²]·E[sin²(x − b)] = (var a + (E a)²) / 2, as E[cos 2(x − b)] = 0 for b ~ U(0, π)
    assert (y ** 2).mean().item() == pytest.approx((4.9 ** 2 / 12 + 2.55 ** 2) / 2, rel=0.03)
    assert torch.equal(t["xc"], t["x"][:, :10]) and torch.equal(t["yc"], t["y"][:, :10])
    with pytest.raises(ValueError, match="num_context"):
        sine.sample_sine_tasks(2, 5, 6, torch.Generator())


def test_models_shapes_and_bad_input():
    xc, yc, xt = torch.randn(3, 4, 1), torch.randn(3, 4, 1), torch.randn(3, 9, 1)
    for name in SINE_MODELS:
        model = build_sine_model(name, 8)
        assert model(xc, yc, xt).shape == (3, 9, 1), name
        with pytest.raises(ValueError, match="expected xc, yc"):
            model(xc, yc[:, :3], xt)
    with pytest.raises(ValueError, match="unknown model"):
        build_sine_model("transformer")
    with pytest.raises(ValueError, match="divisible"):
        build_sine_model("attention", 10, heads=4)


def test_intention_regressor_is_ridge_regression_on_its_features():
    model = build_sine_model("intention", 8, alpha_init=0.3).double()
    xc, yc, xt = torch.randn(2, 6, 1).double(), torch.randn(2, 6, 1).double(), torch.randn(2, 5, 1).double()
    fk, fq = model.embed(xc), model.embed(xt)
    eye = torch.eye(8, dtype=torch.float64)
    want = fq @ torch.linalg.solve(fk.mT @ fk + 0.3 * eye, fk.mT @ yc)
    torch.testing.assert_close(model(xc, yc, xt), want, rtol=1e-8, atol=1e-10)


def test_maml_is_three_inner_gradient_steps():
    torch.manual_seed(0)
    model = build_sine_model("maml", 8, maml_steps=3, maml_lr=0.1).double()
    xc, yc, xt = torch.randn(2, 5, 1).double(), torch.randn(2, 5, 1).double(), torch.randn(2, 4, 1).double()
    got = model(xc, yc, xt)
    for i in range(2):  # plain autograd, one task at a time
        params = [p.detach().clone().requires_grad_() for p in model.net.parameters()]

        def net(x, ps):
            for j in range(0, len(ps) - 2, 2):
                x = torch.relu(x @ ps[j].T + ps[j + 1])
            return x @ ps[-2].T + ps[-1]

        for _ in range(3):
            grads = torch.autograd.grad(((net(xc[i], params) - yc[i]) ** 2).mean(), params)
            params = [(p - 0.1 * g).detach().requires_grad_() for p, g in zip(params, grads)]
        torch.testing.assert_close(got[i], net(xt[i], params), rtol=1e-9, atol=1e-10)


def test_untrained_intention_interpolates_with_many_observations():
    # The paper's claim for Intention at initialisation: ridge regression on random features already fits
    t = sine.sample_sine_tasks(64, 200, 50, torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    stats = sine.evaluate(build_sine_model("intention", 64, alpha_init=0.01), {50: t})
    assert stats["50"]["mse"] < 0.25 * (t["y"] ** 2).mean().item()


@pytest.mark.parametrize("name", ["intention", "np"])
def test_short_training_lowers_the_loss(name):
    args = argparse.Namespace(seed=0, batch=8, num_points=50, train_context=10)
    eval_set = {10: sine.sample_sine_tasks(32, 50, 10, torch.Generator().manual_seed(7))}
    torch.manual_seed(0)
    model = build_sine_model(name, 32, alpha_init=0.01)
    before = sine.evaluate(model, eval_set)["10"]["mse"]
    sine.train(model, 150, 3e-3, args, log_every=50)
    assert sine.evaluate(model, eval_set)["10"]["mse"] < 0.8 * before


def test_cli_end_to_end(tmp_path):
    code = main(["intention", "sine_few_shot", "--out", str(tmp_path), "--steps", "3", "--eval-tasks", "4",
                 "--eval-context", "2,5", "--width", "8", "--models", "intention,maml", "--num-points", "30"])
    assert code == 0
    result = json.loads((tmp_path / "intention_sine_few_shot.json").read_text())
    assert set(result["rows"]) == {"intention", "maml"} and result["config"]["steps"] == 3
    assert set(result["rows"]["maml"]["trained"]) == {"2", "5"}
    md = (tmp_path / "intention_sine_few_shot.md").read_text()
    assert "| Intention | untrained |" in md and "| MAML | trained |" in md and "Paper:" in md
    assert (tmp_path / "intention_sine_few_shot.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match="bad options"):
        main(["intention", "sine_few_shot", "--out", str(tmp_path), "--models", "gpt"])
