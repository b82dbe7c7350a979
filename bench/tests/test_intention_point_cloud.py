"""`python -m bench intention point_cloud`: the remapping data, the four models, a short training, the CLI."""
import json
import math

import pytest
import torch

from bench.__main__ import main
from bench.intention.point_cloud_data import (NOISE_STD, SCALE_RANGE, apply_similarity, rabbit_cloud,
                                              sample_remap_tasks, umeyama)
from bench.intention.point_cloud_models import MODEL_NAMES, build


def test_tasks_have_the_stated_distributions_and_exact_targets():
    b = sample_remap_tasks(20_000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    eye = torch.eye(2, dtype=torch.float64)
    assert torch.allclose(b.rotation @ b.rotation.mT, eye.expand(20_000, 2, 2), atol=1e-12)
    assert torch.allclose(torch.linalg.det(b.rotation), torch.ones(20_000, dtype=torch.float64), atol=1e-12)
    # Rotation angles uniform on the circle: cos and sin average 0 with mean square 1/2.
    cos = b.rotation[:, 0, 0]
    assert abs(float(cos.mean())) < 0.02 and abs(float(cos.pow(2).mean()) - 0.5) < 0.02
    lo, hi = SCALE_RANGE
    assert float(b.scale.min()) >= lo and float(b.scale.max()) <= hi
    assert abs(float(b.scale.mean()) - (lo + hi) / 2) < 0.01
    assert abs(float(b.scale.var()) - (hi - lo) ** 2 / 12) < 0.01
    assert abs(float(b.translation.mean())) < 0.02 and abs(float(b.translation.std()) - 1) < 0.02
    for points in (b.k, b.q):
        assert abs(float(points.mean())) < 0.02 and abs(float(points.std()) - 1) < 0.02
    # Targets: a R q + w written out with the rotation's entries, in float64.
    a, r, w = b.scale[:, None], b.rotation, b.translation[:, None, :]
    x, y = b.q[..., 0], b.q[..., 1]
    expected = torch.stack([a * (r[:, None, 0, 0] * x + r[:, None, 0, 1] * y),
                            a * (r[:, None, 1, 0] * x + r[:, None, 1, 1] * y)], -1) + w
    assert torch.allclose(b.z, expected, atol=1e-12)
    noise = b.v - apply_similarity(b.k, b.scale, b.rotation, b.translation)
    assert abs(float(noise.mean())) < 0.002 and abs(float(noise.std()) - NOISE_STD) < 0.002


def test_same_seed_same_tasks_and_bad_sizes_raise():
    one, two = (sample_remap_tasks(4, generator=torch.Generator().manual_seed(3)) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    with pytest.raises(ValueError, match="sample_remap_tasks"):
        sample_remap_tasks(0)
    with pytest.raises(ValueError, match="apply_similarity"):
        apply_similarity(torch.zeros(2, 5, 3), torch.ones(2), torch.eye(2).expand(2, 2, 2), torch.zeros(2, 2))


def test_umeyama_recovers_the_transform_and_is_the_least_squares_fit():
    clean = sample_remap_tasks(256, noise_std=0.0, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    a, r, w = umeyama(clean.k, clean.v)
    assert torch.allclose(a, clean.scale, atol=1e-10) and torch.allclose(r, clean.rotation, atol=1e-10)
    assert torch.allclose(w, clean.translation, atol=1e-10)
    noisy = sample_remap_tasks(256, noise_std=0.3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    fit = (apply_similarity(noisy.k, *umeyama(noisy.k, noisy.v)) - noisy.v).pow(2).sum((1, 2))
    true = (apply_similarity(noisy.k, noisy.scale, noisy.rotation, noisy.translation) - noisy.v).pow(2).sum((1, 2))
    assert bool((fit <= true + 1e-9).all()) and float((true - fit).min()) >= -1e-9 and float((true - fit).max()) > 0


def test_rabbit_is_normalised_reproducible_and_inside_its_silhouette():
    cloud = rabbit_cloud(3000, torch.Generator().manual_seed(0), dtype=torch.float64)
    assert cloud.shape == (3000, 2)
    assert float(cloud.mean(0).abs().max()) < 1e-12 and abs(float(cloud.pow(2).mean()) - 1) < 1e-12
    assert torch.equal(cloud, rabbit_cloud(3000, torch.Generator().manual_seed(0), dtype=torch.float64))
    # Taller than the body alone because of the ears: the silhouette is not one ellipse.
    assert float(cloud[:, 1].max()) > 1.5 * float(-cloud[:, 1].min())
    with pytest.raises(ValueError, match="rabbit_cloud"):
        rabbit_cloud(0)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_models_map_queries_and_check_shapes(name):
    torch.manual_seed(0)
    model = build(name, 10)
    b = sample_remap_tasks(3, generator=torch.Generator().manual_seed(0))
    assert model(b.k, b.v, b.q).shape == (3, 5, 2)
    with pytest.raises(ValueError, match="Remap"):
        model(b.k, b.v[:, :4], b.q)
    if name == "mlp":
        with pytest.raises(ValueError, match="MLPRemap: built for N=5, M=5"):
            model(b.k, b.v, b.q[:, :4])
    else:  # the set models answer any number of queries, one at a time the same as together
        one = model(b.k, b.v, b.q[:, :1])
        assert torch.allclose(one, model(b.k, b.v, b.q)[:, :1], atol=1e-5)
    with pytest.raises(ValueError, match="unknown model"):
        build("transformer", 10)


def test_short_training_lowers_the_loss():
    from bench.intention.point_cloud import evaluate, train

    torch.manual_seed(0)
    model = build("intention", 32)
    held_out = sample_remap_tasks(256, generator=torch.Generator().manual_seed(99))
    curves = train(model, steps=150, batch=32, lr=3e-3, seed=0, eval_batch=held_out, eval_every=50)
    first, last = curves["eval"][0][1], curves["eval"][-1][1]
    assert len(curves["train_loss"]) == 150 and curves["eval"][-1][0] == 150
    assert last < 0.5 * first, (first, last)
    assert math.isclose(evaluate(model, held_out), last, rel_tol=1e-6)


def test_cli_end_to_end_writes_the_report(tmp_path, capsys):
    code = main(["intention", "point_cloud", "--out", str(tmp_path), "--steps", "6", "--batch", "8",
                 "--eval-every", "3", "--intention-width", "8", "--width", "8", "--eval-tasks", "16",
                 "--rabbit-points", "40"])
    assert code == 0
    result = json.loads((tmp_path / "intention_point_cloud.json").read_text())
    assert set(result["runs"]) == set(MODEL_NAMES)
    assert result["runs"]["attention"]["width"] == 10            # rounded up to a multiple of the 5 heads
    assert all(len(r["train_loss"]) == 6 and [s for s, _ in r["eval"]] == [0, 3, 6] for r in result["runs"].values())
    assert set(result["rabbit"]["mse"]) == set(MODEL_NAMES) and len(result["rabbit"]["cloud"]) == 40
    assert result["references"]["umeyama"] < result["references"]["mean_of_v"]
    md = (tmp_path / "intention_point_cloud.md").read_text()
    assert "Beside the paper" in md and "Umeyama" in md and "| Intention | 8 |" in md
    assert (tmp_path / "intention_point_cloud.png").stat().st_size > 10_000
    assert "eval MSE (final)" in capsys.readouterr().out


def test_a_user_shape_replaces_the_rabbit(tmp_path):
    from bench.intention.point_cloud_data import normalised_cloud

    points = torch.randn(300, 2, dtype=torch.float64) * torch.tensor([3.0, 0.5]) + 7
    cloud = normalised_cloud(points, 100, torch.Generator().manual_seed(0), dtype=torch.float64)
    assert cloud.shape == (100, 2) and cloud.mean(0).abs().max() < 1e-12
    assert math.isclose(float(cloud.pow(2).mean()), 1.0, rel_tol=1e-12)
    assert normalised_cloud(points[:50], 100).shape == (50, 2)              # fewer than asked: all of them
    nan = points.index_fill(0, torch.tensor([3]), float("nan"))
    for bad in (points[:, :1], points[:4], points.long(), torch.zeros(10, 2), nan):
        with pytest.raises(ValueError, match="normalised_cloud"):
            normalised_cloud(bad, 100)
    path = tmp_path / "bunny.pt"
    torch.save(points, path)
    code = main(["intention", "point_cloud", "--out", str(tmp_path), "--steps", "2", "--batch", "4",
                 "--eval-every", "2", "--intention-width", "8", "--width", "8", "--eval-tasks", "8",
                 "--rabbit-points", "40", "--shape", str(path), "--models", "intention", "mlp"])
    assert code == 0
    result = json.loads((tmp_path / "intention_point_cloud.json").read_text())
    assert result["config"]["shape"] == "bunny.pt" and len(result["rabbit"]["cloud"]) == 40
    assert "the rabbit is the point cloud in `bunny.pt`" in (tmp_path / "intention_point_cloud.md").read_text()
