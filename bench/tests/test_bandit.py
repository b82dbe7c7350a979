"""Wheel bandit: the problem's rewards and optimal arms, pre-training batches, deployment through
CMANP's update path (same decisions as recomputing from the history), the CLI end to end."""
import json

import pytest
import torch

from bench.__main__ import main
from bench.np.data.wheel import LARGE_MEAN, WheelSampler, sample_wheel
from attn_ext.models import CMANP, TNPD
from bench.np.tasks.bandit import deploy, make_agent, problem, run_bandits

TINY = dict(num_layers=1, d_model=16, num_heads=2, ff_dim=16, num_latents=4, emb_depth=2)


@pytest.mark.parametrize("delta", [0.0, 0.5, 0.95])
def test_wheel_rewards_and_optimal_arms(delta):
    d = sample_wheel(4000, delta, torch.Generator().manual_seed(1))
    r = d.x.norm(dim=1)
    assert (r <= 1).all()
    outer = r >= delta
    assert (d.opt_action[~outer] == 0).all() and (d.opt_action[outer] > 0).all()
    assert torch.allclose(d.rewards[outer].max(1).values, torch.full((int(outer.sum()),), LARGE_MEAN), atol=0.1)
    # Outside δ the optimal arm is the one paying 50; inside it is arm 0 by its mean (1.2 vs 1.0), even
    # where the noise made another arm pay more on that draw.
    assert (d.rewards[outer].argmax(1) == d.opt_action[outer]).all()
    assert torch.allclose(d.opt_reward, d.rewards[torch.arange(4000), d.opt_action])
    # Quadrant arms: 1 = +x+y, 2 = −x+y, 3 = −x−y, 4 = +x−y.
    x = d.x[outer]
    expected = torch.where(x[:, 1] > 0, torch.where(x[:, 0] > 0, 1, 2), torch.where(x[:, 0] <= 0, 3, 4))
    assert (d.opt_action[outer] == expected).all()
    assert abs(outer.float().mean().item() - (1 - delta ** 2)) < 0.03


def test_wheel_sampler_and_errors():
    b = WheelSampler(32, 8).sample(3, torch.Generator().manual_seed(0))
    assert b.xc.shape == (3, 32, 2) and b.yc.shape == (3, 32, 5) and b.xt.shape == (3, 8, 2)
    with pytest.raises(ValueError, match="delta must be in"):
        sample_wheel(10, 1.5)


def test_cmanp_update_path_decides_as_recomputation():
    torch.manual_seed(0)
    model = CMANP(dim_x=2, dim_y=5, **TINY)
    data = problem(0.7, 40, seed=3)
    inc, rec = deploy(model, data, seed=5, mode="incremental"), deploy(model, data, seed=5, mode="recompute")
    assert inc["mode"] == "incremental" and rec["mode"] == "recompute"
    assert torch.equal(inc["action"], rec["action"])
    assert torch.allclose(inc["uniform_regret"], data.opt_reward - data.rewards.mean(1))
    with pytest.raises(ValueError, match="no condition/update/query"):
        make_agent(TNPD(dim_x=2, dim_y=5, **TINY), "incremental")


def test_run_bandits_normalises_to_uniform():
    torch.manual_seed(0)
    out = run_bandits({"tnpd": TNPD(dim_x=2, dim_y=5, **TINY)}, [0.9], steps=12, seeds=2)["tnpd"]
    assert out["mode"] == "recompute" and len(out["regret_pct"][0.9]) == 2 and out["step_seconds"].shape == (12,)
    assert torch.isclose(out["uniform_cum_regret"][0.9][-1],
                         sum((problem(0.9, 12, s).opt_reward - problem(0.9, 12, s).rewards.mean(1)).sum()
                             for s in range(2)).double() / 2)


def test_bandit_cli(tmp_path, capsys):
    small = ["--num-layers", "1", "--d-model", "16", "--num-heads", "2", "--ff-dim", "16", "--num-latents", "4"]
    for model in ("cmanp", "tnpd"):
        assert main(["train", "wheel", "--model", model, "--steps", "2", "--num-context", "16", "--num-target", "4",
                     "--out", str(tmp_path / model), *small]) == 0
    assert main(["bandit", "--ckpt", str(tmp_path / "cmanp"), str(tmp_path / "tnpd"), "--steps", "8", "--seeds", "1",
                 "--deltas", "0.7", "0.99", "--out", str(tmp_path / "res")]) == 0
    table = capsys.readouterr().out
    assert "cmanp (incremental)" in table and "history-blind" in table
    res = json.loads((tmp_path / "res" / "bandit.json").read_text())
    assert set(res["results"]) == {"cmanp", "tnpd"} and (tmp_path / "res" / "bandit.png").stat().st_size > 0
    assert main(["train", "gp", "--model", "tnpd", "--steps", "1", "--out", str(tmp_path / "gp"), *small]) == 0
    assert main(["bandit", "--ckpt", str(tmp_path / "gp"), "--steps", "2", "--seeds", "1"]) == 1
    assert "pre-train with `python -m bench train wheel`" in capsys.readouterr().err


def test_pulled_context_rewards_show_one_arm():
    b = WheelSampler(64, 8, context_rewards="pulled").sample(2, torch.Generator().manual_seed(0))
    full = WheelSampler(64, 8).sample(2, torch.Generator().manual_seed(0))
    # Exactly one arm per context point keeps its true reward (all are >= 0.8; N(0, 1) noise rarely is).
    kept = (b.yc == full.yc).sum(-1)
    assert (kept >= 1).all() and kept.float().mean() < 1.3 and torch.equal(b.yt, full.yt)
    with pytest.raises(ValueError, match="context_rewards"):
        WheelSampler(context_rewards="some")


def test_history_blind_policy_pulls_the_quadrant_arm():
    from bench.np.tasks.bandit import history_blind_regret_pct, quadrant_arms

    data = problem(0.9, 400, 0)
    arms = quadrant_arms(data.x)
    outer = data.x.norm(dim=1) >= 0.9
    assert torch.equal(arms[outer], data.opt_action[outer])  # outside the radius it is optimal
    # ... and inside it loses arm 0's margin of about 0.2 per step; uniform loses more everywhere.
    pct = history_blind_regret_pct(0.9, 400, 2)
    inner_loss = (data.opt_reward - data.rewards[torch.arange(400), arms])[~outer].mean()
    assert abs(inner_loss.item() - 0.2) < 0.05 and len(pct) == 2 and all(0 < p < 100 for p in pct)
    assert history_blind_regret_pct(0.0, 100, 1) == [pytest.approx(0.0, abs=1e-3)]  # δ = 0: all outer
