"""The kernelised-size task (Intention paper, Fig. 14): episode statistics, models, training, CLI."""
import json

import pytest
import torch
from torch.nn import functional as F

from bench.__main__ import main
from bench.intention.kernelised_size_data import EpisodeSampler
from bench.intention.kernelised_size_models import build_classifier, evaluate, train_classifier


def _episodes(n=400, **kw):
    return EpisodeSampler(**kw).sample(n, generator=torch.Generator().manual_seed(0))


def test_episode_layout_and_balanced_labels():
    ep = _episodes(3)
    assert ep.xc.shape == (3, 25, 32) and ep.xt.shape == (3, 75, 32)
    assert torch.equal(torch.bincount(ep.yc[1], minlength=5), torch.full((5,), 5))
    assert torch.equal(torch.bincount(ep.yt[2], minlength=5), torch.full((5,), 15))


def test_episode_statistics():
    sampler = EpisodeSampler(mode_spread=1.5, noise_std=0.3)
    ep = sampler.sample(400, generator=torch.Generator().manual_seed(0))
    # Mode centres ~ N(0, 1.5²): mean 0, std 1.5 (in float64, over 400·5·2·8 draws).
    modes = ep.modes.double()
    assert abs(modes.mean().item()) < 0.03 and abs(modes.std().item() - 1.5) < 0.03
    # Every latent point is its class's nearest mode plus N(0, 0.3²) noise: the distance to the
    # nearest mode of its own class has the noise's second moment 8 · 0.3².
    z, y = ep.zt.double(), ep.yt
    own = modes[torch.arange(400)[:, None], y]                                  # [B, N_t, modes, 8]
    residual = (z[:, :, None] - own).pow(2).sum(-1).min(-1).values
    assert abs(residual.mean().item() / 8 - 0.09) < 0.01
    # Both modes are used about equally often.
    nearest = (z[:, :, None] - own).pow(2).sum(-1).argmin(-1).double()
    assert abs(nearest.mean().item() - 0.5) < 0.02
    # Observations are the fixed renderer of the latents (the same renderer for every episode).
    assert torch.allclose(ep.xt, sampler.render(ep.zt)) and torch.allclose(ep.xc, sampler.render(ep.zc))
    other = EpisodeSampler(mode_spread=1.5, noise_std=0.3, renderer_seed=7)
    assert not torch.allclose(other.render(ep.zt), ep.xt)


def test_sampler_rejects_bad_sizes():
    with pytest.raises(ValueError, match="EpisodeSampler"):
        EpisodeSampler(ways=1)
    with pytest.raises(ValueError, match="EpisodeSampler"):
        EpisodeSampler().sample(0)


def test_plain_model_is_the_least_squares_fit():
    # P̂ = E_Q (E_KᵀE_K + αI)⁻¹ E_Kᵀ Y in float64 on the model's own embeddings.
    torch.manual_seed(0)
    model = build_classifier("intention", 32, 16, 5).double()
    ep = _episodes(2)
    xc, xt = ep.xc.double(), ep.xt.double()
    ek, eq = model.embed(model.encoder(xc)), model.embed(model.encoder(xt))
    alpha = F.softplus(model.raw_alpha)
    y = F.one_hot(ep.yc, 5).double()
    expected = eq @ torch.linalg.solve(ek.mT @ ek + alpha * torch.eye(16, dtype=torch.float64), ek.mT @ y)
    assert torch.allclose(model(xc, ep.yc, xt), expected, atol=1e-8)


def test_kernelised_model_is_kernel_ridge_regression():
    torch.manual_seed(0)
    model = build_classifier("kernelised", 32, 16, 5, jitter=0.0).double()
    ep = _episodes(2)
    xc, xt = ep.xc.double(), ep.xt.double()
    ek, eq = model.embed(model.encoder(xc)), model.embed(model.encoder(xt))
    ell, alpha = model.log_lengthscale.exp(), F.softplus(model.raw_alpha)
    kqk = torch.exp(-torch.cdist(eq, ek) ** 2 / (2 * ell ** 2))
    kkk = torch.exp(-torch.cdist(ek, ek) ** 2 / (2 * ell ** 2))
    y = F.one_hot(ep.yc, 5).double()
    expected = kqk @ torch.linalg.solve(kkk + alpha * torch.eye(25, dtype=torch.float64), y)
    assert torch.allclose(model(xc, ep.yc, xt), expected, atol=1e-6)


@pytest.mark.parametrize("name", ["intention", "kernelised"])
def test_short_training_lowers_loss_and_beats_chance(name):
    torch.manual_seed(0)
    sampler = EpisodeSampler()
    model = build_classifier(name, 32, 16, 5)
    result = train_classifier(model, sampler, steps=60, batch=8, lr=3e-3, generator=torch.Generator().manual_seed(0))
    assert result["last_loss"] < result["first_loss"] - 0.01
    scores = evaluate(model, [sampler.sample(50, generator=torch.Generator().manual_seed(5))])
    assert scores["accuracy"] > 0.4  # chance is 0.2


def test_nystrom_option_runs():
    model = build_classifier("kernelised", 32, 16, 5, landmarks=10)
    assert torch.isfinite(model.loss(_episodes(2)))


def test_cli_end_to_end(tmp_path, capsys):
    rc = main(["intention", "kernelised_size", "--out", str(tmp_path), "--latents", "4", "8", "--steps", "3",
               "--batch", "2", "--eval-episodes", "3", "--seeds", "1"])
    assert rc == 0
    stem = tmp_path / "intention_kernelised_size"
    for ext in (".md", ".json", ".png"):
        assert (stem.with_suffix(ext)).stat().st_size > 0
    data = json.loads(stem.with_suffix(".json").read_text())
    assert {(r["model"], r["latent"]) for r in data["rows"]} == {(m, s) for m in ("intention", "kernelised")
                                                                for s in (4, 8)}
    assert "Figure 14" in stem.with_suffix(".md").read_text() and "kernelised accuracy" in capsys.readouterr().out


def test_cli_rejects_bad_budget(tmp_path):
    assert main(["intention", "kernelised_size", "--out", str(tmp_path), "--steps", "0"]) == 2
