"""`python -m bench intention image_regression`: image completion as regression (Figs. 7 and 13), on glyphs."""
import argparse
import json
import math

import pytest
import torch

from bench.__main__ import main
from bench.intention import image_regression as task
from bench.intention.image_glyphs import pixel_tasks, render_polylines, sample_glyphs
from bench.intention.image_models import IMAGE_MODELS, build_image_model, fourier_features


def test_glyph_statistics():
    g = sample_glyphs(4000, 28, torch.Generator().manual_seed(0))
    images, labels = g["images"].double(), g["labels"]
    assert images.shape == (4000, 28, 28) and images.min() >= 0 and images.max() <= 1
    counts = torch.bincount(labels, minlength=10).double()
    assert counts.min() > 0.08 * 4000 and counts.max() < 0.12 * 4000  # uniform over the ten templates
    # MNIST-like: mostly background, about a fifth of the pixels inked, the border nearly empty
    assert 0.15 < images.mean() < 0.25 and 0.15 < (images > 0.5).double().mean() < 0.25
    assert images[:, [0, -1], :].mean() < 0.06 and images[:, :, [0, -1]].mean() < 0.01
    # ten different shapes: the class means differ, and a 1 carries less ink than an 8
    means = torch.stack([images[labels == k].mean(0) for k in range(10)])
    distances = torch.cdist(means.flatten(1), means.flatten(1)).fill_diagonal_(9)
    assert means[1].sum() < means[8].sum() and distances.min() > 1
    with pytest.raises(ValueError, match="side"):
        sample_glyphs(2, 2, torch.Generator())


def test_render_polylines_is_the_distance_formula():
    side = 16
    v = torch.tensor([[[0.2, 0.3], [0.8, 0.6], [0.8, 0.6]]], dtype=torch.float64)  # one segment, padded
    ink = render_polylines(v, torch.tensor([0.05], dtype=torch.float64), side)[0]
    for row in range(side):
        for col in range(side):
            p = torch.tensor([(col + 0.5) / side, (row + 0.5) / side], dtype=torch.float64)
            a, b = v[0, 0], v[0, 1]
            t = float(((p - a) @ (b - a)) / ((b - a) @ (b - a)))
            d = float((p - (a + min(max(t, 0.0), 1.0) * (b - a))).norm())
            assert ink[row, col].item() == pytest.approx(min(max(1 - (d - 0.05) * side, 0.0), 1.0), abs=1e-12)
    with pytest.raises(ValueError, match="render_polylines"):
        render_polylines(v[:, :1], torch.tensor([0.05]), side)


def test_pixel_tasks():
    images = torch.rand(3, 5, 4, generator=torch.Generator().manual_seed(0))
    t = pixel_tasks(images, 7, torch.Generator().manual_seed(1))
    assert t["x"].shape == (3, 20, 2) and t["xc"].shape == (3, 7, 2) and t["yc"].shape == (3, 7, 1)
    assert t["x"].min() > -1 and t["x"].max() < 1
    for b in range(3):
        assert len(set(t["index"][b].tolist())) == 7  # without replacement
        for i, k in enumerate(t["index"][b].tolist()):
            row, col = divmod(k, 4)
            assert t["yc"][b, i, 0] == images[b, row, col]
            torch.testing.assert_close(t["xc"][b, i], torch.tensor([(col + 0.5) / 4 * 2 - 1, (row + 0.5) / 5 * 2 - 1]))
    with pytest.raises(ValueError, match="num_context"):
        pixel_tasks(images, 21, torch.Generator())


def test_fourier_features_and_model_shapes():
    p = torch.tensor([[0.25, -0.5]], dtype=torch.float64)
    f = fourier_features(p, 2)[0]
    want = [0.25, -0.5] + [math.sin(s * math.pi * c) for c in (0.25, -0.5) for s in (1, 2)] \
        + [math.cos(s * math.pi * c) for c in (0.25, -0.5) for s in (1, 2)]
    torch.testing.assert_close(f, torch.tensor(want, dtype=torch.float64))
    xc, yc, xt = torch.rand(2, 6, 2), torch.rand(2, 6, 1), torch.rand(2, 9, 2)
    for name in IMAGE_MODELS:
        model = build_image_model(name, 8, frequencies=2)
        assert model(xc, yc, xt).shape == (2, 9, 1), name
        with pytest.raises(ValueError, match="expected xc"):
            model(xc[..., :1], yc, xt)
    with pytest.raises(ValueError, match="unknown model"):
        build_image_model("cnn")


def test_intention_regressor_is_ridge_regression_on_its_features():
    model = build_image_model("intention", 8, frequencies=2, alpha_init=0.3).double()
    xc, yc, xt = (torch.rand(2, 6, 2).double(), torch.rand(2, 6, 1).double(), torch.rand(2, 5, 2).double())
    fk, fq = model.embed(fourier_features(xc, 2)), model.embed(fourier_features(xt, 2))
    want = fq @ torch.linalg.solve(fk.mT @ fk + 0.3 * torch.eye(8, dtype=torch.float64), fk.mT @ yc)
    torch.testing.assert_close(model(xc, yc, xt), want, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("name", ["intention", "np"])
def test_short_training_lowers_the_loss(name):
    args = argparse.Namespace(seed=0, batch=8, side=12, train_context=40)
    gen = torch.Generator().manual_seed(7)
    eval_set = {40: pixel_tasks(sample_glyphs(32, 12, gen)["images"], 40, gen)}
    torch.manual_seed(0)
    model = build_image_model(name, 32, frequencies=2)
    before = task.evaluate(model, eval_set)["40"]["mse"]
    task.train(model, 120, 3e-3, args, log_every=40)
    assert task.evaluate(model, eval_set)["40"]["mse"] < 0.8 * before


def test_cli_end_to_end(tmp_path):
    code = main(["intention", "image_regression", "--out", str(tmp_path), "--steps", "2", "--eval-images", "3",
                 "--eval-context", "5,20", "--width", "8", "--side", "10", "--train-context", "20",
                 "--models", "intention,maml"])
    assert code == 0
    result = json.loads((tmp_path / "intention_image_regression.json").read_text())
    assert set(result["rows"]) == {"intention", "maml"} and result["config"]["steps"] == 2
    assert set(result["rows"]["maml"]["trained"]) == {"5", "20"}
    assert len(result["rows"]["intention"]["completions"]["trained"]["20"][0]) == 100
    md = (tmp_path / "intention_image_regression.md").read_text()
    assert "| Intention | untrained |" in md and "| MAML | trained |" in md and "Paper:" in md
    assert (tmp_path / "intention_image_regression.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match="bad options"):
        main(["intention", "image_regression", "--out", str(tmp_path), "--eval-context", "5000"])


def test_image_bank_scales_checks_and_splits(tmp_path):
    from bench.intention.image_bank import ImageBank

    train = torch.randint(0, 256, (6, 5, 5), dtype=torch.uint8)
    bank = ImageBank({"train": train, "test": torch.rand(3, 5, 5)}, source="x.pt")
    assert bank.side == 5 and torch.equal(bank.train, train.double() / 255)
    assert torch.equal(bank.evaluation(2), bank.test[:2].float()) and bank.evaluation(9).shape == (3, 5, 5)
    drawn = bank.sample(4, torch.Generator().manual_seed(0))
    assert drawn.shape == (4, 5, 5) and all(any(torch.equal(d, t.float()) for t in bank.train) for d in drawn)
    assert "6 training and 3 test images, 5×5" in bank.describe()
    bad = [({"train": train}, "need a dict with 'train'"), ({"train": train[:, :, :4], "test": train}, "square"),
           ({"train": train, "test": torch.rand(2, 4, 4)}, "differ in size"),
           ({"train": 2 * torch.rand(2, 5, 5), "test": train}, "in \\[0, 1\\]"),
           ({"train": train.long(), "test": train}, "uint8")]
    for data, message in bad:
        with pytest.raises(ValueError, match=message):
            ImageBank(data)


def test_cli_runs_on_an_images_file(tmp_path):
    path = tmp_path / "digits.pt"
    torch.save({"train": torch.randint(0, 256, (20, 8, 8), dtype=torch.uint8),
                "test": torch.randint(0, 256, (6, 8, 8), dtype=torch.uint8)}, path)
    code = main(["intention", "image_regression", "--out", str(tmp_path), "--steps", "2", "--batch", "2",
                 "--images", str(path), "--eval-images", "4", "--eval-context", "5,20", "--train-context", "10",
                 "--width", "8", "--models", "intention,np"])
    assert code == 0
    result = json.loads((tmp_path / "intention_image_regression.json").read_text())
    assert result["config"]["side"] == 8 and "digits.pt" in result["config"]["data"]
    md = (tmp_path / "intention_image_regression.md").read_text()
    assert "the images in `digits.pt` (20 training and 6 test images, 8×8)" in md and "glyphs are" not in md
