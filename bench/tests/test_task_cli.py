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


SMALL = ["--model", "tnpd", "--d-model", "16", "--num-layers", "1", "--num-heads", "2", "--ff-dim", "16",
         "--emb-depth", "2"]


def test_train_and_eval_sawtooth(tmp_path, capsys):
    import torch

    run, cache = tmp_path / "saw", tmp_path / "cache"
    assert main(["train", "sawtooth", *SMALL, "--steps", "3", "--out", str(run), "--log-every", "3"]) == 0
    ckpt = torch.load(run / "checkpoint.pt", weights_only=False)
    assert ckpt["task"] == "sawtooth" and ckpt["config"]["dim_x"] == 2 and ckpt["step"] == 3
    assert ckpt["task_settings"] == {"dim_x": 2, "num_context": 64, "num_target": 128, "noise_std": 0.025}
    assert main(["eval", "sawtooth", "--ckpt", str(run), "--num-batches", "2", "--data-dir", str(cache)]) == 0
    assert "tnpd sawtooth (dim_x 2, N_c 64, N_t 128): log-likelihood" in capsys.readouterr().out
    result = json.loads((run / "eval_sawtooth_dim2_nc64_nt128.json").read_text())
    assert result["num_batches"] == 2 and result["noise_std"] == 0.025 and np.isfinite(result["log_likelihood_mean"])
    assert [p.name for p in cache.iterdir()] == ["sawtooth_dim2_eval_freq3-5_noise0.025_nc64_nt128_seed0_b16_n2.pt"]
    # Other settings are stored as given, and a sawtooth run is not a GP run.
    other = tmp_path / "saw1d"
    assert main(["train", "sawtooth", *SMALL, "--steps", "1", "--out", str(other), "--dim-x", "1",
                 "--num-context", "10", "--num-target", "5", "--noise-std", "0.1"]) == 0
    assert torch.load(other / "checkpoint.pt", weights_only=False)["task_settings"] == {
        "dim_x": 1, "num_context": 10, "num_target": 5, "noise_std": 0.1}
    capsys.readouterr()
    assert main(["eval", "gp", "--ckpt", str(run), "--num-batches", "1", "--data-dir", str(cache)]) == 1
    assert "is a 'sawtooth' run; `eval gp` needs a gp run" in capsys.readouterr().err
    assert main(["train", "sawtooth", *SMALL, "--steps", "1", "--out", str(tmp_path / "bad"), "--dim-x", "0"]) == 1
    assert "dim_x must be a positive int" in capsys.readouterr().err


def test_train_and_eval_2d_gp(tmp_path, capsys):
    import torch

    run, cache = tmp_path / "gp2", tmp_path / "cache"
    assert main(["train", "gp", "--chapter-2d", *SMALL, "--steps", "3", "--out", str(run), "--kernel", "matern52"]) == 0
    ckpt = torch.load(run / "checkpoint.pt", weights_only=False)
    assert ckpt["task_settings"] == {"kernel": "matern52", "length_range": "code", "dim_x": 2, "num_context": 64,
                                     "num_target": 128}
    assert ckpt["config"]["dim_x"] == 2
    assert main(["eval", "gp", "--ckpt", str(run), "--num-batches", "2", "--data-dir", str(cache)]) == 0
    assert "tnpd rbf (dim_x 2, N_c 64, N_t 128): log-likelihood" in capsys.readouterr().out
    # Not eval_rbf.json: the 1-D GP report must not take it for a 1-D result.
    assert sorted(p.name for p in run.glob("eval_*.json")) == ["eval_rbf_dim2_nc64_nt128.json"]
    assert json.loads((run / "eval_rbf_dim2_nc64_nt128.json").read_text())["dim_x"] == 2
    # The counts can be overridden at evaluation (another set, another file); the dimension cannot change.
    assert main(["eval", "gp", "--ckpt", str(run), "--num-batches", "1", "--num-context", "10", "--data-dir",
                 str(cache)]) == 0
    assert (run / "eval_rbf_dim2_nc10_nt128.json").exists()
    # --dim-x alone keeps the random counts; resuming with another dimension is refused.
    rand = tmp_path / "gp2rand"
    assert main(["train", "gp", "--dim-x", "2", *SMALL, "--steps", "1", "--out", str(rand)]) == 0
    assert torch.load(rand / "checkpoint.pt", weights_only=False)["task_settings"] == {
        "kernel": "rbf", "length_range": "code", "dim_x": 2}
    capsys.readouterr()
    assert main(["train", "gp", "--dim-x", "3", *SMALL, "--steps", "1", "--out", str(rand)]) == 1
    assert "use another --out or --restart" in capsys.readouterr().err
    capsys.readouterr()
    assert main(["eval", "sawtooth", "--ckpt", str(rand), "--num-batches", "1", "--data-dir", str(cache)]) == 1
    assert "is a 'gp' run; `eval sawtooth` needs a sawtooth run" in capsys.readouterr().err


def test_1d_gp_settings_are_those_of_older_runs(tmp_path):
    import torch

    # Resuming compares the stored task settings: a 1-D run must store exactly what runs stored before
    # the input dimension and the counts became options, or old runs would refuse to resume.
    assert main(["train", "gp", *SMALL, "--steps", "1", "--out", str(tmp_path)]) == 0
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert ckpt["task_settings"] == {"kernel": "rbf", "length_range": "code"} and ckpt["config"]["dim_x"] == 1
