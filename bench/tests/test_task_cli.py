"""End-to-end ``python -m bench train/eval`` on tiny configurations: GP, image completion (sklearn digits and
a tiny EMNIST in IDX files), the copy task; resume and task mismatch."""
import json

import numpy as np
import pytest

from bench.__main__ import main

TINY = ["--num-layers", "1", "--d-model", "16", "--num-heads", "2", "--ff-dim", "16", "--num-latents", "4",
        "--emb-depth", "2"]


def test_train_gp_resume_matches_and_eval(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["train", "gp", "--model", "cmanp", "--steps", "4", "--out", str(a), "--log-every", "2", *TINY]) == 0
    assert main(["train", "gp", "--model", "cmanp", "--steps", "4", "--out", str(b), "--stop-after", "2", *TINY]) == 0
    assert main(["train", "gp", "--model", "cmanp", "--steps", "4", "--out", str(b), *TINY]) == 0
    import torch

    sa, sb = (torch.load(d / "checkpoint.pt", weights_only=False)["model_state"] for d in (a, b))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert main(["eval", "gp", "--ckpt", str(a), "--num-batches", "2", "--data-dir", str(tmp_path / "cache")]) == 0
    assert "log-likelihood" in capsys.readouterr().out
    # A missing dataset fails with the files it expected, before any training.
    capsys.readouterr()
    assert main(["train", "images", "--dataset", "emnist", "--data-dir", str(tmp_path), "--model", "cmanp",
                 "--steps", "4", "--out", str(a), *TINY]) == 1
    assert "emnist-balanced-train-images-idx3-ubyte.gz" in capsys.readouterr().err


def _tiny_emnist(root):
    from bench.np.data.image_files import write_idx

    rng = np.random.default_rng(0)
    for split, n in (("train", 20), ("test", 47)):
        write_idx(root / f"emnist-balanced-{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        write_idx(root / f"emnist-balanced-{split}-labels-idx1-ubyte.gz", np.arange(n, dtype=np.uint8) % 47)


def test_train_and_eval_images_emnist_files(tmp_path, capsys):
    data, run = tmp_path / "emnist", tmp_path / "run"
    data.mkdir()
    _tiny_emnist(data)
    assert main(["train", "images", "--dataset", "emnist", "--data-dir", str(data), "--model", "tnpd",
                 "--steps", "2", "--batch-size", "2", "--out", str(run), "--plot-images", "2", *TINY]) == 0
    assert (run / "completions.png").stat().st_size > 0
    assert main(["eval", "images", "--ckpt", str(run), "--num-batches", "1", "--plot-images", "0"]) == 0
    out = capsys.readouterr().out
    assert "emnist seen" in out and "emnist unseen" in out
    result = json.loads((run / "eval_emnist_unseen.json").read_text())
    assert result["num_batches"] == 1 and np.isfinite(result["log_likelihood_mean"])


def test_train_images_digits_and_missing_dataset(tmp_path, capsys):
    pytest.importorskip("sklearn", reason="the digits image set needs scikit-learn, which the harness does not require (pip install scikit-learn)")
    run = tmp_path / "digits"
    assert main(["train", "images", "--dataset", "digits", "--model", "retreever", "--steps", "2",
                 "--out", str(run), "--plot-images", "1", *TINY]) == 0
    assert main(["eval", "images", "--ckpt", str(run), "--num-batches", "1"]) == 0
    assert (run / "completions_test.png").exists()
    assert main(["train", "images", "--dataset", "celeba32", "--data-dir", str(tmp_path), "--model", "cmanp",
                 "--steps", "2", "--out", str(tmp_path / "c")]) == 1
    assert "list_eval_partition.txt" in capsys.readouterr().err


def test_train_copy(tmp_path, capsys):
    assert main(["train", "copy", "--seq-len", "16", "--steps", "3", "--eval-size", "16", "--log-every", "3",
                 "--dim", "16", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "copy_tca.json").read_text())
    assert r["read"] == 4 and r["context"] == 8 and 0 <= r["accuracy"] <= 1
    assert "tokens read per query 4/8" in capsys.readouterr().out
    assert main(["train", "copy", "--seq-len", "12", "--steps", "1"]) == 1


def test_resume_refuses_another_task(tmp_path, capsys):
    pytest.importorskip("sklearn", reason="the digits image set needs scikit-learn, which the harness does not require (pip install scikit-learn)")
    run = tmp_path / "run"
    assert main(["train", "gp", "--model", "lbanp", "--steps", "2", "--out", str(run), *TINY]) == 0
    assert main(["train", "images", "--dataset", "digits", "--model", "lbanp", "--steps", "2", "--out", str(run),
                 *TINY]) == 1
    assert "use another --out or --restart" in capsys.readouterr().err
