"""The training log: the gradient norm it records, files from before it recorded one, and replaying a
stretch of a run from a kept checkpoint."""
import math
import shutil

import pytest
import torch

from bench.np.checkpoint import load_checkpoint
from bench.np.train import train
from bench.np.train_history import HISTORY, read_history, start_history

TINY = dict(d_model=8, num_layers=1, num_heads=2, ff_dim=16, emb_depth=2)
QUIET = dict(overrides=TINY, log=lambda m: None)


def first_step_gradient_norm(model_name: str, seed: int = 0) -> float:
    """The gradient norm of the first training step, computed outside the training loop."""
    from attn_ext.models import build_model
    from bench.np.tasks.np_tasks import gp_task

    task = gp_task()
    torch.manual_seed(seed)
    model = build_model(model_name, **TINY, dim_x=task.dim_x, dim_y=task.dim_y)
    model.train()
    model(task.sample(16, torch.Generator().manual_seed(seed + 1))).backward()
    grads = [p.grad.double().flatten() for p in model.parameters() if p.grad is not None]
    return torch.cat(grads).norm().item()


def test_the_logged_gradient_norm_is_the_global_norm_before_the_step(tmp_path):
    train("tnpd", 4, tmp_path / "one", log_every=1, checkpoint_every=4, **QUIET)
    points = read_history(tmp_path / "one")
    assert points[0].grad_norm == pytest.approx(first_step_gradient_norm("tnpd"), rel=1e-5)
    assert all(p.grad_norm == p.grad_norm_max for p in points)
    train("tnpd", 4, tmp_path / "two", log_every=2, checkpoint_every=4, **QUIET)
    pairs = read_history(tmp_path / "two")
    assert [p.step for p in pairs] == [2, 4]
    for pair, (a, b) in zip(pairs, [points[0:2], points[2:4]]):
        assert pair.grad_norm == pytest.approx((a.grad_norm + b.grad_norm) / 2, rel=1e-5)
        assert pair.grad_norm_max == pytest.approx(max(a.grad_norm, b.grad_norm), rel=1e-5)


def test_histories_written_before_the_gradient_norm_still_read_and_resume(tmp_path):
    (tmp_path / HISTORY).write_text("step,loss,lr,steps_per_s\n500,-0.5,0.0005,4.2\n1000,-0.6,0.0005,4.3\n")
    old = read_history(tmp_path)
    assert [(p.step, p.loss) for p in old] == [(500, -0.5), (1000, -0.6)]
    assert all(math.isnan(p.grad_norm) and math.isnan(p.grad_norm_max) for p in old)
    start_history(tmp_path, 500)
    assert (tmp_path / HISTORY).read_text().splitlines() == [
        "step,loss,lr,steps_per_s,grad_norm,grad_norm_max", "500,-0.5,0.0005,4.2,,"]


def test_a_kept_checkpoint_replays_the_rest_of_the_run_exactly(tmp_path):
    train("lbanp", 6, tmp_path / "run", log_every=1, checkpoint_every=3, keep_every=2, **QUIET)
    kept = sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*.pt"))
    assert kept == ["checkpoint-000002.pt", "checkpoint-000004.pt", "checkpoint-000006.pt"]
    assert load_checkpoint(tmp_path / "run")[1]["step"] == 6
    (tmp_path / "replay").mkdir()
    shutil.copyfile(tmp_path / "run" / "checkpoint-000002.pt", tmp_path / "replay" / "checkpoint.pt")
    train("lbanp", 6, tmp_path / "replay", log_every=1, checkpoint_every=3, **QUIET)
    (whole, _), (replayed, _) = load_checkpoint(tmp_path / "run"), load_checkpoint(tmp_path / "replay")
    for (name, p), q in zip(whole.state_dict().items(), replayed.state_dict().values()):
        assert torch.equal(p, q), name
    after = [p for p in read_history(tmp_path / "run") if p.step > 2]
    assert [(p.step, p.loss, p.grad_norm) for p in after] == [
        (p.step, p.loss, p.grad_norm) for p in read_history(tmp_path / "replay")]


def test_keep_every_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep_every must be positive"):
        train("tnpd", 2, tmp_path, keep_every=0, **QUIET)


def test_keep_every_on_the_command_line(tmp_path):
    from bench.__main__ import main

    tiny = ["--d-model", "8", "--num-layers", "1", "--num-heads", "2", "--ff-dim", "16", "--emb-depth", "2"]
    assert main(["train", "gp", "--model", "tnpd", "--steps", "3", "--out", str(tmp_path), "--keep-every", "2",
                 *tiny]) == 0
    assert sorted(p.name for p in tmp_path.glob("checkpoint*.pt")) == ["checkpoint-000002.pt", "checkpoint.pt"]


def test_clip_grad_norm_scales_the_step_and_logs_the_norm_before_clipping(tmp_path):
    train("tnpd", 2, tmp_path / "clipped", log_every=1, clip_grad_norm=0.5, stop_after=1, **QUIET)
    unclipped = first_step_gradient_norm("tnpd")
    assert unclipped > 0.5
    assert read_history(tmp_path / "clipped")[0].grad_norm == pytest.approx(unclipped, rel=1e-5)
    # Adam's first moment after one step is (1 - beta1) times the gradient it was given.
    _, ckpt = load_checkpoint(tmp_path / "clipped")
    first_moment = torch.cat([s["exp_avg"].flatten() for s in ckpt["optimiser"]["state"].values()])
    assert first_moment.norm().item() == pytest.approx(0.1 * 0.5, rel=1e-5)
    assert ckpt["clip_grad_norm"] == 0.5
    # Resuming without the clipping would train another recipe; runs from before the option resume.
    with pytest.raises(ValueError, match="clip_grad_norm=0.5"):
        train("tnpd", 2, tmp_path / "clipped", **QUIET)
    with pytest.raises(ValueError, match="clip_grad_norm must be positive"):
        train("tnpd", 2, tmp_path / "other", clip_grad_norm=0.0, **QUIET)
    del ckpt["clip_grad_norm"]
    torch.save(ckpt, tmp_path / "clipped" / "checkpoint.pt")
    assert train("tnpd", 2, tmp_path / "clipped", **QUIET)["final_step"] == 2
