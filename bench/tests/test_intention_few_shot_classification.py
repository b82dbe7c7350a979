"""`python -m bench intention few_shot_classification`: the stand-in data, the classifiers, a short training, the CLI."""
import json

import pytest
import torch

import attn_ext as ae
from bench.__main__ import main
from bench.intention.classification_models import CLASSIFIERS, build_classifier, raw_feature_scores
from bench.intention.embedding_data import EmbeddingWorld, sample_episodes


def test_world_features_follow_the_stated_model():
    world = EmbeddingWorld(num_classes=10, num_train_classes=8, latent_dim=4, nuisance_dim=3, dim=12,
                           separation=1.5, nuisance_std=2.0, seed=3)
    labels = torch.full((40_000,), 9)
    x, z = world.sample(labels, torch.Generator().manual_seed(0), dtype=torch.float64)
    # Class part: centred on the class centre with unit variance; nuisance part: mean 0, std 2.
    assert torch.allclose(z[:, :4].mean(0), world.centres[9], atol=0.03)
    assert torch.allclose(z[:, :4].std(0), torch.ones(4, dtype=torch.float64), atol=0.02)
    assert float(z[:, 4:].mean(0).abs().max()) < 0.05
    assert torch.allclose(z[:, 4:].std(0), torch.full((3,), 2.0, dtype=torch.float64), atol=0.04)
    # Features are relu(A z + b), written out entry by entry.
    expected = torch.stack([torch.clamp(sum(world.mixing[i, j] * z[:, j] for j in range(7)) + world.bias[i], min=0)
                            for i in range(12)], -1)
    assert torch.allclose(x, expected, atol=1e-12)
    # Centres have the stated spread over classes (loose: only 10 × 4 draws), and the world is reproducible.
    assert 1.0 < float(world.centres.std()) < 2.0
    again = EmbeddingWorld(num_classes=10, num_train_classes=8, latent_dim=4, nuisance_dim=3, dim=12,
                           separation=1.5, nuisance_std=2.0, seed=3)
    assert torch.equal(world.mixing, again.mixing) and torch.equal(world.centres, again.centres)


def test_episodes_use_distinct_classes_of_their_split():
    world = EmbeddingWorld(num_classes=12, num_train_classes=7, latent_dim=3, nuisance_dim=1, dim=5, seed=0)
    xc, yc, xq, yq = sample_episodes(world, 200, ways=5, shots=2, queries=3, split="test",
                                     generator=torch.Generator().manual_seed(1))
    assert xc.shape == (200, 10, 5) and xq.shape == (200, 15, 5)
    assert yc[0].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4] and yq[0].tolist() == sum([[c] * 3 for c in range(5)], [])
    # Distinct classes per episode: no two episode classes have the same context mean.
    onehot = torch.nn.functional.one_hot(yc, 5).double()
    means = onehot.mT @ xc.double() / 2
    assert float(torch.cdist(means, means).add(torch.eye(5) * 1e9).min()) > 0
    with pytest.raises(ValueError, match="need 6 distinct test classes"):
        sample_episodes(world, 1, ways=6, split="test")
    with pytest.raises(ValueError, match="split"):
        world.classes("val")
    with pytest.raises(ValueError, match="EmbeddingWorld.sample"):
        world.sample(torch.tensor([12]))


def test_class_split_is_disjoint_and_ls_svm_reference_is_the_ridge_formula():
    world = EmbeddingWorld(seed=0)
    assert set(world.classes("train").tolist()).isdisjoint(world.classes("test").tolist())
    assert len(world.classes("train")) == 80 and len(world.classes("test")) == 20
    xc, yc, xq, _ = sample_episodes(world, 3, generator=torch.Generator().manual_seed(0))
    xc, xq = xc.double(), xq.double()
    scores = raw_feature_scores("ls_svm", xc, yc, xq)
    k = torch.cat([xc, torch.full_like(xc[..., :1], 10.0)], -1)
    q = torch.cat([xq, torch.full_like(xq[..., :1], 10.0)], -1)
    y = 2 * torch.nn.functional.one_hot(yc, 5).double() - 1
    w = torch.linalg.solve(k.mT @ k + torch.eye(k.shape[-1], dtype=torch.float64), k.mT @ y)
    assert torch.allclose(scores, q @ w, atol=1e-8)


@pytest.mark.parametrize("name", list(CLASSIFIERS))
def test_classifiers_score_every_query_and_check_shapes(name):
    torch.manual_seed(0)
    model = build_classifier(name, 12, hidden=8, latent=8, kernel_latent=4, heads=2)
    world = EmbeddingWorld(num_classes=10, num_train_classes=8, dim=12)
    xc, yc, xq, yq = sample_episodes(world, 2, queries=3, generator=torch.Generator().manual_seed(0))
    assert model(xc, yc, xq).shape == (2, 15, 5)
    assert torch.isfinite(model.loss(xc, yc, xq, yq))
    # Permutation invariance over the context: shuffling it leaves the scores unchanged.
    perm = torch.randperm(25)
    assert torch.allclose(model(xc[:, perm], yc[:, perm], xq), model(xc, yc, xq), atol=1e-4)
    with pytest.raises(ValueError, match="expected xc"):
        model(xc[..., :5], yc, xq)
    with pytest.raises(ValueError, match="unknown model"):
        build_classifier("matching_networks", 12)


def test_maml_classifier_is_second_order_inner_steps_on_the_context():
    torch.manual_seed(0)
    model = build_classifier("maml", 6, hidden=5, latent=4, maml_steps=2, maml_lr=0.3).double()
    world = EmbeddingWorld(num_classes=10, num_train_classes=8, dim=6)
    xc, yc, xq, yq = sample_episodes(world, 2, queries=2, generator=torch.Generator().manual_seed(1))
    xc, xq = xc.double(), xq.double()
    names = [n for n, _ in model.net.named_parameters()]
    loss = model.loss(xc, yc, xq, yq)
    got = torch.autograd.grad(loss, list(model.net.parameters()))
    outer = 0
    for i in range(2):  # plain autograd, one episode at a time, keeping the inner graph
        params = dict(model.net.named_parameters())
        for _ in range(2):
            inner = torch.nn.functional.cross_entropy(torch.func.functional_call(model.net, params, (xc[i],)), yc[i])
            grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
            params = {n: params[n] - 0.3 * g for n, g in zip(names, grads)}
        scores = torch.func.functional_call(model.net, params, (xq[i],))
        torch.testing.assert_close(model(xc[i:i + 1], yc[i:i + 1], xq[i:i + 1])[0], scores, rtol=1e-9, atol=1e-10)
        outer = outer + torch.nn.functional.cross_entropy(scores, yq[i], reduction="sum")
    want = torch.autograd.grad(outer / yq.numel(), list(model.net.parameters()))
    for g, w in zip(got, want):            # the second-order terms are in the meta-gradient
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-10)
    with torch.no_grad():                   # adaptation still runs where the evaluation turns gradients off
        assert torch.isfinite(model(xc, yc, xq)).all()


def test_sigma_intention_classifier_returns_log_probabilities_of_the_op():
    torch.manual_seed(0)
    model = build_classifier("sigma_intention", 12, hidden=8, latent=8)
    world = EmbeddingWorld(num_classes=10, num_train_classes=8, dim=12)
    xc, yc, xq, _ = sample_episodes(world, 2, queries=3, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        probs = model(xc, yc, xq).exp()
        assert torch.allclose(probs.sum(-1), torch.ones(2, 15), atol=1e-4)
        # A query equal to a context item's input is more likely its class than under a flat softmax.
        ec = model.embed(model.encoder(xc))
        direct = ae.sigma_intention(model.log_scale.exp() * torch.cat([ec, torch.full_like(ec[..., :1], 10.0)], -1)[:, None],
                                    torch.cat([ec, torch.full_like(ec[..., :1], 10.0)], -1)[:, None],
                                    torch.nn.functional.one_hot(yc, 5).float()[:, None],
                                    alpha=torch.nn.functional.softplus(model.raw_alpha))[:, 0]
        assert torch.allclose(model(xc, yc, xc).exp(), direct, atol=1e-5)


def test_short_training_lowers_the_loss_and_beats_chance():
    from bench.intention.few_shot_classification import evaluate, train

    world = EmbeddingWorld(seed=0)
    torch.manual_seed(0)
    model = build_classifier("intention", 64, hidden=32, latent=32)
    test = sample_episodes(world, 200, split="test", generator=torch.Generator().manual_seed(9))
    curves = train(model, world, steps=60, batch=8, lr=3e-3, seed=0)
    losses = curves["train_loss"]
    assert len(losses) == 60
    assert sum(losses[-10:]) / 10 < 0.8 * sum(losses[:10]) / 10, (losses[:10], losses[-10:])
    result = evaluate(model.eval(), test)
    assert result["episodes"] == 200 and result["accuracy"] > 35 and 0 < result["ci95"] < 5


def test_cli_end_to_end_writes_the_report(tmp_path, capsys):
    code = main(["intention", "few_shot_classification", "--out", str(tmp_path), "--steps", "4", "--batch", "2",
                 "--eval-episodes", "12", "--hidden", "8", "--latent", "8", "--heads", "2"])
    assert code == 0
    result = json.loads((tmp_path / "intention_few_shot_classification.json").read_text())
    assert set(result["runs"]) == set(CLASSIFIERS)
    assert all(len(r["train_loss"]) == 4 and r["episodes"] == 12 for r in result["runs"].values())
    assert result["runs"]["intention"]["loss"] == "MSE" and result["runs"]["attention"]["loss"] == "cross-entropy"
    assert set(result["references"]) == {"ls_svm", "nearest_mean"}
    md = (tmp_path / "intention_few_shot_classification.md").read_text()
    assert "Beside the paper" in md and "67.30 / 70.05" in md and "| MAML | Table 1 |" in md
    assert (tmp_path / "intention_few_shot_classification.png").stat().st_size > 10_000
    assert "test accuracy (± 95 %)" in capsys.readouterr().out
