"""Real embeddings in the Intention classification and anomaly tasks: the bank, its samplers, `--features`."""
import json

import pytest
import torch

from bench.__main__ import main
from bench.intention.embedding_data import sample_episodes, sample_outlier_sets
from bench.intention.feature_bank import FeatureBank


def bank_file(tmp_path, classes=12, per_class=25, dim=6, seed=0):
    """A saved bank whose class ids are scattered (not 0..C-1) and whose features carry the class."""
    g = torch.Generator().manual_seed(seed)
    labels = (torch.arange(classes) * 7 + 3).repeat_interleave(per_class)
    centres = 3 * torch.randn(classes, dim, generator=g)
    features = centres.repeat_interleave(per_class, 0) + torch.randn(classes * per_class, dim, generator=g)
    path = tmp_path / "bank.pt"
    torch.save({"features": features, "labels": labels}, path)
    return path, features, labels


def test_bank_relabels_splits_by_class_and_validates(tmp_path):
    path, features, labels = bank_file(tmp_path)
    bank = FeatureBank.load(path)
    assert (bank.num_classes, bank.num_train_classes, bank.dim) == (12, 10, 6)       # 80 % of 12, rounded
    assert torch.equal(bank.classes("train"), torch.arange(10)) and torch.equal(bank.classes("test"), torch.arange(10, 12))
    assert torch.equal(bank.labels, torch.arange(12).repeat_interleave(25))           # ascending ids -> 0..11
    assert "bank.pt" in bank.describe() and "300 items of 12 classes" in bank.describe()
    assert FeatureBank.load(path, num_train_classes=3).num_train_classes == 3
    bad = [((features[:, 0], labels), "real \\[n, dim\\]"), ((features, labels[:-1]), "integer \\[n\\]"),
           ((features, labels.double()), "integer \\[n\\]"),
           ((features.index_fill(0, torch.tensor([4]), float("nan")), labels), "NaN"),
           ((features, torch.zeros_like(labels)), "at least 2 classes")]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            FeatureBank(*args)
    with pytest.raises(ValueError, match="num_train_classes"):
        FeatureBank(features, labels, num_train_classes=12)
    torch.save([features, labels], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="must hold a dict with 'features'"):
        FeatureBank.load(tmp_path / "list.pt")


def test_draws_are_items_of_the_asked_class_and_distinct_within_a_row(tmp_path):
    path, features, _ = bank_file(tmp_path)
    bank = FeatureBank.load(path)
    asked = torch.tensor([[0, 0, 0, 11, 11], [5, 5, 5, 5, 5]])
    x, rows = bank.sample(asked, torch.Generator().manual_seed(1), dtype=torch.float64)
    assert torch.equal(bank.labels[rows], asked) and torch.equal(x, features.double()[rows])
    assert all(len(set(r.tolist())) == len(r) for r in rows)
    with pytest.raises(ValueError, match="class 2 has 25 items, a draw needs 26"):
        bank.sample(torch.full((1, 26), 2))
    with pytest.raises(ValueError, match="labels must be a non-empty integer tensor in \\[0, 12\\)"):
        bank.sample(torch.tensor([[12]]))


def test_episodes_and_outlier_sets_from_a_bank(tmp_path):
    bank = FeatureBank.load(bank_file(tmp_path)[0])
    g = torch.Generator().manual_seed(2)
    xc, yc, xq, yq = sample_episodes(bank, 3, ways=2, shots=5, queries=15, split="test", generator=g)
    assert xc.shape == (3, 10, 6) and xq.shape == (3, 30, 6)
    for b in range(3):   # no query repeats a context item of its episode (one joint, distinct draw)
        items = {tuple(row.tolist()) for row in torch.cat([xc[b], xq[b]])}
        assert len(items) == 40
    x, outlier = sample_outlier_sets(bank, 4, set_size=10, split="train", generator=g)
    assert x.shape == (4, 10, 6) and outlier.shape == (4,)


@pytest.mark.parametrize("task", ["few_shot_classification", "anomaly_detection"])
def test_cli_runs_on_a_features_file(tmp_path, task):
    path, _, _ = bank_file(tmp_path)
    small = (["--eval-episodes", "8", "--hidden", "8", "--latent", "8", "--heads", "2",
              "--models", "intention", "prototypical"] if task == "few_shot_classification" else
             ["--eval-sets", "8", "--heads", "2", "--head-dim", "4", "--layers", "1",
              "--models", "informer", "transformer"])
    code = main(["intention", task, "--out", str(tmp_path), "--steps", "2", "--batch", "2",
                 "--features", str(path), "--train-classes", "7", *small])
    assert code == 0
    result = json.loads((tmp_path / f"intention_{task}.json").read_text())
    assert result["config"]["dim"] == 6 and result["config"]["train_classes"] == 7
    md = (tmp_path / f"intention_{task}.md").read_text()
    assert "the features in `bank.pt` (300 items of 12 classes, 6-d; 7 training / 5 unseen test classes)" in md
    assert "stand-in" not in md.split("Beside the paper")[0]
    with pytest.raises(ValueError, match="--train-classes needs --features"):
        main(["intention", task, "--out", str(tmp_path), "--steps", "1", "--train-classes", "7", *small])


def test_docstring_example_runs():
    import doctest

    from bench.intention import feature_bank

    result = doctest.testmod(feature_bank)
    assert result.attempted > 0 and result.failed == 0
