"""`python -m bench intention policy_distillation`: the navigation data and environment, the models, training, the CLI."""
import json

import pytest
import torch

from bench.__main__ import main
from bench.intention.policy_distillation_data import (MAX_STEP, PROBE_STD, TARGET_STD, greedy_action,
                                                      least_squares_target, rollout, sample_navigation_tasks)
from bench.intention.policy_distillation_models import MODEL_NAMES, build


def test_tasks_have_the_papers_distributions_and_exact_distances():
    b = sample_navigation_tasks(20_000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    t, p, d = b.target, b.obs[..., :2], b.obs[..., 2]
    assert abs(float(t.mean())) < 0.02 and abs(float(t.std()) - TARGET_STD) < 0.02
    assert abs(float(p.mean())) < 0.01 and abs(float(p.var()) - PROBE_STD ** 2) < 0.005
    assert abs(float(torch.corrcoef(torch.stack([t[:, 0], t[:, 1]]))[0, 1])) < 0.03
    # d_i = (x_i − t_x)² + (y_i − t_y)² written out; E[d] = 2·(1 + 1/4).
    expected = (p[..., 0] - t[:, None, 0]) ** 2 + (p[..., 1] - t[:, None, 1]) ** 2
    assert torch.allclose(d, expected, atol=1e-12)
    assert abs(float(d.mean()) - 2.5) < 0.03
    same = sample_navigation_tasks(20_000, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(same.obs.double(), b.obs, atol=1e-5)          # float32 holds the same tasks
    with pytest.raises(ValueError, match="sample_navigation_tasks"):
        sample_navigation_tasks(0)


def test_least_squares_recovers_the_target_exactly_and_rejects_bad_shapes():
    b = sample_navigation_tasks(512, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    assert torch.allclose(least_squares_target(b.obs), b.target, atol=1e-9)
    assert torch.allclose(least_squares_target(b.obs[:, :3]), b.target, atol=1e-8)   # 3 probes suffice
    with pytest.raises(ValueError, match="least_squares_target"):
        least_squares_target(b.obs[:, :2])


def test_environment_rollout_matches_a_hand_computation():
    target = torch.tensor([[0.25, -0.05], [0.0, 0.0]], dtype=torch.float64)
    ret, final = rollout(target, target, horizon=3)
    # Agent 1: positions (0.1, −0.05), (0.2, −0.05), (0.25, −0.05); agent 2 stays at its target.
    assert torch.allclose(ret, torch.tensor([-(0.15 + 0.05), 0.0], dtype=torch.float64), atol=1e-12)
    assert torch.allclose(final, torch.zeros(2, dtype=torch.float64), atol=1e-12)
    # Aiming at the wrong goal costs return: the agent ends at the goal, 1.0 away from the target.
    wrong, far = rollout(target + torch.tensor([1.0, 0.0], dtype=torch.float64), target, horizon=50)
    assert bool((wrong < ret).all()) and torch.allclose(far, torch.ones(2, dtype=torch.float64), atol=1e-12)
    a = greedy_action(torch.zeros(1, 2), torch.tensor([[3.0, -0.02]]))
    assert torch.allclose(a, torch.tensor([[MAX_STEP, -0.02]]))
    with pytest.raises(ValueError, match="rollout"):
        rollout(target[:1], target)


def test_models_shapes_and_bad_input():
    obs = torch.randn(3, 5, 3)
    for name in MODEL_NAMES:
        model = build(name, 10)
        assert model(obs).shape == (3, 2), name
        with pytest.raises(ValueError, match="need obs"):
            model(obs[..., :2])
    with pytest.raises(ValueError, match="unknown model"):
        build("transformer", 8)
    with pytest.raises(ValueError, match="multiple of heads"):
        build("attention", 8)


def test_short_training_lowers_the_error():
    from bench.intention.policy_distillation import train

    torch.manual_seed(0)
    model = build("intention", 32)
    eval_batch = sample_navigation_tasks(256, generator=torch.Generator().manual_seed(5))
    curves = train(model, steps=150, batch=32, lr=3e-3, seed=0, eval_batch=eval_batch, eval_every=150)
    (_, before), (_, after) = curves["eval"]
    assert after < 0.5 * before, (before, after)


def test_cli_end_to_end_writes_the_report(tmp_path, capsys):
    code = main(["intention", "policy_distillation", "--out", str(tmp_path), "--steps", "6", "--batch", "8",
                 "--eval-every", "3", "--width-scale", "0.02", "--eval-tasks", "16", "--horizon", "20"])
    assert code == 0
    result = json.loads((tmp_path / "intention_policy_distillation.json").read_text())
    assert set(result["runs"]) == set(MODEL_NAMES)
    assert result["runs"]["attention"]["width"] == 5                 # rounded up to a multiple of the 5 heads
    assert result["runs"]["intention"]["lr"] == 3e-5 and result["runs"]["mlp"]["lr"] == 3e-4
    assert all(len(r["train_loss"]) == 6 and [s for s, _ in r["eval"]] == [0, 3, 6] for r in result["runs"].values())
    ref = result["references"]
    assert ref["least_squares"]["mse"] < 1e-8 < ref["prior_mean"]["mse"]
    assert ref["expert"]["return"] >= ref["least_squares"]["return"] - 1e-6 > ref["prior_mean"]["return"]
    assert len(result["examples"]) == 4 and set(result["examples"][0]["prediction"]) == set(MODEL_NAMES)
    md = (tmp_path / "intention_policy_distillation.md").read_text()
    assert "Beside the paper" in md and "least-squares target" in md and "| Intention | 10 |" in md
    assert (tmp_path / "intention_policy_distillation.png").stat().st_size > 10_000
    assert "target MSE" in capsys.readouterr().out
