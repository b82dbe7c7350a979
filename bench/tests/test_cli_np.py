"""`python -m bench train gp` → `eval gp` → `memory` end to end on a tiny configuration, and resuming."""
import json

import torch

from bench.__main__ import main

TINY = ["--d-model", "8", "--num-layers", "1", "--num-heads", "2", "--ff-dim", "16", "--emb-depth", "2",
        "--num-latents", "4"]


def test_train_eval_memory_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ATTN_EXT_DATA", str(tmp_path / "data"))
    run = tmp_path / "run"
    assert main(["train", "gp", "--model", "cmanp", "--steps", "6", "--out", str(run), "--log-every", "3",
                 "--checkpoint-every", "3", "--chunk-size", "5", *TINY]) == 0
    assert (run / "checkpoint.pt").exists() and json.loads((run / "train.json").read_text())["final_step"] == 6
    assert main(["eval", "gp", "--ckpt", str(run), "--kernel", "matern52", "--num-batches", "3"]) == 0
    out = capsys.readouterr().out
    assert "cmanp matern52: log-likelihood" in out and "±" in out
    result = json.loads((run / "eval_matern52.json").read_text())
    assert result["num_batches"] == 3 and result["train_steps"] == 6
    mem_dir = tmp_path / "mem"
    # One cell over the 20 MB cap (TNP-D's [N, N] scores at N_c = 3000), one measured: the sweep goes on.
    assert main(["memory", "--models", "tnpd_masked", "--nc", "3000", "--nt", "5", "--fixed-nt", "5",
                 "--fixed-nc", "10", "--cap-mb", "20", "--out", str(mem_dir), "--timeout", "120"]) == 0
    md = (mem_dir / "np_memory.md").read_text()
    rows = json.loads((mem_dir / "np_memory.json").read_text())["rows"]
    assert [r["status"] for r in rows][0] == "> cap" and rows[1]["peak_extra_mb"] is not None
    assert "| tnpd_masked | > cap |" in md and (mem_dir / "np_memory.png").exists()


def test_resume_matches_uninterrupted(tmp_path):
    from bench.np.checkpoint import load_checkpoint
    from bench.np.train import train
    from bench.np.train_history import LogPoint, append_history, read_history

    tiny = dict(d_model=8, num_layers=1, num_heads=2, ff_dim=16, emb_depth=2)
    quiet = dict(overrides=tiny, checkpoint_every=2, log_every=2, log=lambda m: None)
    train("retreever", 6, tmp_path / "a", **quiet)
    train("retreever", 6, tmp_path / "b", stop_after=4, **quiet)
    assert load_checkpoint(tmp_path / "b")[1]["step"] == 4
    # A run killed after logging step 6 but before checkpointing it: that row is trained again.
    append_history(tmp_path / "b", LogPoint(6, 99.0, 0.0, 1.0))
    train("retreever", 6, tmp_path / "b", **quiet)
    (a, _), (b, ckpt) = load_checkpoint(tmp_path / "a"), load_checkpoint(tmp_path / "b")
    assert ckpt["step"] == 6
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
    whole, resumed = read_history(tmp_path / "a"), read_history(tmp_path / "b")
    assert [p.step for p in whole] == [p.step for p in resumed] == [2, 4, 6]
    assert [p.loss for p in whole] == [p.loss for p in resumed] and resumed[-1].loss != 99.0
    # --restart starts the curve again.
    train("retreever", 2, tmp_path / "b", restart=True, **quiet)
    assert [p.step for p in read_history(tmp_path / "b")] == [2]


def test_train_rejects_a_foreign_checkpoint(tmp_path, capsys):
    args = ["train", "gp", "--steps", "2", "--out", str(tmp_path), *TINY]
    assert main([*args, "--model", "tnpd"]) == 0
    assert main([*args, "--model", "lbanp"]) == 1
    assert "use another --out or --restart" in capsys.readouterr().err


def test_model_options_are_kept_in_the_checkpoint(tmp_path, capsys):
    from bench.np.checkpoint import load_checkpoint

    run = tmp_path / "run"
    args = ["train", "gp", "--model", "retreever", "--steps", "2", "--out", str(run), *TINY]
    assert main([*args, "--aggregator", "mean", "--backprop-through-tree"]) == 0
    model, ckpt = load_checkpoint(run)
    assert ckpt["model_options"] == {"aggregator": "mean", "backprop_through_tree": True}
    assert model.tca.aggregator == "mean" and model.tca.backprop_through_tree
    # Resuming with other options (here the defaults) would silently train another model.
    assert main(args) == 1
    assert "use another --out or --restart" in capsys.readouterr().err
    assert main(["train", "gp", "--model", "tnpd", "--steps", "1", "--out", str(tmp_path / "t"),
                 "--aggregator", "mean", *TINY]) == 1
    assert "--aggregator applies to retreever only, not tnpd" in capsys.readouterr().err


def test_block_is_kept_and_old_lbanp_checkpoints_resume_as_prenorm(tmp_path, capsys):
    from bench.np.checkpoint import load_checkpoint

    args = ["train", "gp", "--model", "lbanp", "--steps", "2", *TINY]
    assert main([*args, "--out", str(tmp_path / "p"), "--block", "perceiver"]) == 0
    model, ckpt = load_checkpoint(tmp_path / "p")
    assert ckpt["model_options"] == {"block": "perceiver"} and model.query_embedder is not None
    # LBANP checkpoints written before the option stored no options ({}); they were pre-norm.
    assert main([*args, "--out", str(tmp_path / "old"), "--stop-after", "1"]) == 0
    ckpt = torch.load(tmp_path / "old" / "checkpoint.pt", weights_only=False)
    ckpt["model_options"] = {}
    torch.save(ckpt, tmp_path / "old" / "checkpoint.pt")
    assert load_checkpoint(tmp_path / "old")[0].options() == {"block": "prenorm"}
    assert main([*args, "--out", str(tmp_path / "old")]) == 0
    assert main([*args, "--out", str(tmp_path / "old"), "--block", "perceiver"]) == 1
    assert "model_options={'block': 'prenorm'}" in capsys.readouterr().err
    assert main(["train", "gp", "--model", "tnpd", "--steps", "1", "--out", str(tmp_path / "t"),
                 "--block", "perceiver", *TINY]) == 1
    assert "--block applies to lbanp, cmanp, cmanp_and only, not tnpd" in capsys.readouterr().err
    assert main(["train", "gp", "--model", "cmanp", "--steps", "1", "--out", str(tmp_path / "c"),
                 "--block", "perceiver", *TINY]) == 0
    assert load_checkpoint(tmp_path / "c")[1]["model_options"] == {"block": "perceiver"}
    assert main(["train", "gp", "--model", "lbanp", "--steps", "1", "--out", str(tmp_path / "o"),
                 "--block", "official", *TINY]) == 0
    model, ckpt = load_checkpoint(tmp_path / "o")
    assert ckpt["model_options"] == {"block": "official"} and model.cross[0].attention.in_proj_bias is None


def test_checkpoints_from_before_options_were_stored_load_with_the_defaults_of_their_time(tmp_path):
    from bench.np.checkpoint import load_checkpoint
    from bench.np.train import train

    tiny = dict(d_model=8, num_layers=1, num_heads=2, ff_dim=16, emb_depth=2)
    train("retreever", 1, tmp_path, overrides=tiny, options={"aggregator": "mean", "backprop_through_tree": True},
          log=lambda m: None)
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert ckpt["model_options"] == {"aggregator": "mean", "backprop_through_tree": True}
    del ckpt["model_options"]
    torch.save(ckpt, tmp_path / "checkpoint.pt")
    model, _ = load_checkpoint(tmp_path)
    assert model.options() == {"aggregator": "mean", "backprop_through_tree": True}
    # Options not given are stored resolved, so a later change of default cannot change the run.
    train("retreever", 1, tmp_path / "b", overrides=tiny, log=lambda m: None)
    stored = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["model_options"]
    assert stored == {"aggregator": "transformer", "backprop_through_tree": False}


def test_weight_decay_reaches_adam_and_resuming_keeps_the_recipe(tmp_path, capsys):
    from bench.np.checkpoint import load_checkpoint

    run = tmp_path / "run"
    args = ["train", "gp", "--model", "lbanp", "--steps", "3", "--out", str(run), *TINY]
    assert main([*args, "--weight-decay", "1e-4", "--stop-after", "1"]) == 0
    _, ckpt = load_checkpoint(run)
    assert ckpt["weight_decay"] == 1e-4 and ckpt["optimiser"]["param_groups"][0]["weight_decay"] == 1e-4
    # The optimiser's saved state would silently replace these; another config would not even load.
    for other, named in ((["--weight-decay", "0"], "weight_decay=0.0001; asked for weight_decay=0.0"),
                         (["--weight-decay", "1e-4", "--lr", "1e-3"], "lr=0.0005; asked for lr=0.001"),
                         (["--weight-decay", "1e-4", "--batch-size", "8"], "batch_size=16; asked for batch_size=8"),
                         (["--weight-decay", "1e-4", "--num-latents", "2"], "'num_latents': 2")):
        assert main([*args, *other]) == 1  # a repeated option: argparse keeps the last
        err = capsys.readouterr().err
        assert "was trained with" in err and named in err and "use another --out or --restart" in err, err
    assert main([*args, "--weight-decay", "1e-4"]) == 0
    assert load_checkpoint(run)[1]["step"] == 3
    assert main([*args, "--weight-decay", "-1", "--restart"]) == 1
    assert "weight_decay non-negative" in capsys.readouterr().err


def test_sawtooth_resume_matches_uninterrupted(tmp_path):
    # The batch generator's state in the checkpoint replays the Sawtooth stream as it does the GP one.
    small = ["--model", "tnpd", "--d-model", "8", "--num-layers", "1", "--num-heads", "2", "--ff-dim", "16",
             "--emb-depth", "2", "--steps", "4", "--num-context", "16", "--num-target", "8"]
    assert main(["train", "sawtooth", *small, "--out", str(tmp_path / "a")]) == 0
    assert main(["train", "sawtooth", *small, "--out", str(tmp_path / "b"), "--stop-after", "2"]) == 0
    assert main(["train", "sawtooth", *small, "--out", str(tmp_path / "b")]) == 0
    sa, sb = (torch.load(tmp_path / d / "checkpoint.pt", weights_only=False)["model_state"] for d in "ab")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert main(["train", "sawtooth", *small, "--out", str(tmp_path / "b"), "--noise-std", "0.1"]) == 1
