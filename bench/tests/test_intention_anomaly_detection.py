"""`python -m bench intention anomaly_detection`: the outlier sets, the five -formers, a short training, the CLI."""
import json

import pytest
import torch

import attn_ext as ae
from bench.__main__ import main
from bench.intention.anomaly_models import FORMERS, build_former, farthest_from_rest
from bench.intention.embedding_data import EmbeddingWorld, sample_outlier_sets


def test_outlier_sets_have_one_item_of_another_class_at_a_uniform_position():
    world = EmbeddingWorld(num_classes=6, num_train_classes=4, latent_dim=3, nuisance_dim=1, dim=8,
                           separation=3.0, nuisance_std=0.0, seed=1)
    gen = torch.Generator().manual_seed(0)
    x, outlier = sample_outlier_sets(world, 6000, set_size=10, generator=gen)
    assert x.shape == (6000, 10, 8) and bool((x >= 0).all())
    counts = torch.bincount(outlier, minlength=10).double()
    assert float((counts / 6000 - 0.1).abs().max()) < 0.015                     # uniform positions
    # With no nuisance and well separated classes the farthest-from-the-rest rule is nearly always right.
    assert float((farthest_from_rest(x) == outlier).double().mean()) > 0.9
    with pytest.raises(ValueError, match="sample_outlier_sets"):
        sample_outlier_sets(world, 4, set_size=1)


def test_outlier_sets_draw_only_the_requested_split():
    # Classes 0, 1 train and 2, 3 test; far-apart centres make every item's class readable from its features.
    world = EmbeddingWorld(num_classes=4, num_train_classes=2, latent_dim=2, nuisance_dim=1, dim=4,
                           separation=50.0, nuisance_std=0.0, seed=0)
    x, outlier = sample_outlier_sets(world, 200, set_size=4, split="test", generator=torch.Generator().manual_seed(0))
    # With separation 50 the latent of every item is within a few units of its class centre: classes 2, 3 only.
    inlier = x[torch.arange(200), (outlier + 1) % 4]
    test_means = torch.relu(torch.cat([world.centres[2:], torch.zeros(2, 1, dtype=torch.float64)], -1)
                            @ world.mixing.T + world.bias).float()
    nearest = torch.cdist(inlier, test_means).min(-1).values
    train_means = torch.relu(torch.cat([world.centres[:2], torch.zeros(2, 1, dtype=torch.float64)], -1)
                             @ world.mixing.T + world.bias).float()
    assert bool((nearest < torch.cdist(inlier, train_means).min(-1).values).all())


@pytest.mark.parametrize("name", list(FORMERS))
def test_formers_score_every_item_and_are_permutation_equivariant(name):
    torch.manual_seed(0)
    model = build_former(name, 12, layers=2, heads=2, head_dim=4).eval()
    x = torch.rand(3, 10, 12)
    logits = model(x)
    assert logits.shape == (3, 10)
    perm = torch.randperm(10)
    assert torch.allclose(model(x[:, perm]), logits[:, perm], atol=1e-4)
    with pytest.raises(ValueError, match="expected x"):
        model(x[..., :5])
    with pytest.raises(ValueError, match="unknown model"):
        build_former("mamba", 12)


def test_informer_block_is_the_papers_dual_form():
    """Q Kᵀ[(1−a)KKᵀ + aI]⁻¹ V (the paper's appendix) equals the op call the block makes, in float64."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 4, dtype=torch.float64) for _ in range(3))
    a = torch.sigmoid(torch.randn(3, dtype=torch.float64))
    eye = torch.eye(10, dtype=torch.float64)
    dual = q @ k.mT @ torch.linalg.solve((1 - a).view(1, 3, 1, 1) * k @ k.mT + a.view(1, 3, 1, 1) * eye, v)
    ours = ae.intention(q / (1 - a).view(1, 3, 1, 1), k, v, alpha=a / (1 - a))
    assert torch.allclose(ours, dual, atol=1e-9)
    scores = q @ k.mT @ torch.linalg.inv((1 - a).view(1, 3, 1, 1) * k @ k.mT + a.view(1, 3, 1, 1) * eye)
    sigma = ae.sigma_intention(q / (1 - a).view(1, 3, 1, 1), k, v, alpha=a / (1 - a))
    assert torch.allclose(sigma, torch.softmax(scores, -1) @ v, atol=1e-9)


def test_short_training_lowers_the_loss():
    from bench.intention.anomaly_detection import train

    # Easier than the report's world (wider class spread, weaker nuisance) so that seconds of training show.
    world = EmbeddingWorld(separation=2.0, nuisance_std=1.0, seed=0)
    torch.manual_seed(0)
    model = build_former("informer", 64, layers=1, heads=2, head_dim=8)
    losses = train(model, world, steps=80, batch=32, lr=3e-3, seed=0)["train_loss"]
    assert len(losses) == 80
    assert sum(losses[-10:]) / 10 < 0.85 * sum(losses[:10]) / 10, (losses[:10], losses[-10:])


def test_cli_end_to_end_writes_the_report(tmp_path, capsys):
    code = main(["intention", "anomaly_detection", "--out", str(tmp_path), "--steps", "3", "--batch", "4",
                 "--eval-sets", "20", "--heads", "2", "--head-dim", "4"])
    assert code == 0
    result = json.loads((tmp_path / "intention_anomaly_detection.json").read_text())
    assert set(result["runs"]) == set(FORMERS)
    assert all(set(r) == {"1", "4"} and len(r["4"]["train_loss"]) == 3 for r in result["runs"].values())
    assert all(0 <= r["1"]["accuracy"] <= 100 for r in result["runs"].values())
    md = (tmp_path / "intention_anomaly_detection.md").read_text()
    assert "Beside the paper" in md and "| σ-Informer | 95.3 % |" in md
    assert (tmp_path / "intention_anomaly_detection.png").stat().st_size > 10_000
    assert "farthest from the rest" in capsys.readouterr().out
