"""A short training run (bench.np.train) lowers the loss: the fastest model, a small configuration.

Moved with the training loop from python_tests/test_models_training.py."""
import torch

from attn_ext.data import GPSampler
from attn_ext.models import build_model
from bench.np.checkpoint import load_checkpoint
from bench.np.train import train


def _held_out_nll(model, batches):
    model.eval()
    with torch.no_grad():
        value = -torch.stack([model.log_likelihood(b).mean() for b in batches]).mean().item()
    model.train()
    return value


def test_200_steps_lower_the_loss(tmp_path):
    gen = torch.Generator().manual_seed(123)
    held_out = [GPSampler().sample(16, generator=gen) for _ in range(8)]
    small = dict(d_model=32, num_layers=2, num_heads=2, ff_dim=64, emb_depth=2)
    torch.manual_seed(0)
    before = _held_out_nll(build_model("linear_tnp", **small), held_out)
    train("linear_tnp", 200, tmp_path, overrides=small, checkpoint_every=200, log_every=200, lr=2e-3,
          log=lambda msg: None)
    model, ckpt = load_checkpoint(tmp_path)
    after = _held_out_nll(model, held_out)
    assert ckpt["step"] == 200
    assert after < before - 0.2, (before, after)


def test_sawtooth_training_lowers_the_loss(tmp_path):
    # The chapter's 2-D Sawtooth task through the same loop: a wrong dimension or a broken sampler
    # (targets not a function of x the model can see) would not move the held-out likelihood this much.
    from bench.np.tasks.np_tasks import sawtooth_task

    task = sawtooth_task()
    gen = torch.Generator().manual_seed(123)
    held_out = [task.sample(16, gen) for _ in range(4)]
    small = dict(d_model=16, num_layers=1, num_heads=2, ff_dim=32, emb_depth=2)
    torch.manual_seed(0)
    before = _held_out_nll(build_model("tnpd", dim_x=2, **small), held_out)
    train("tnpd", 60, tmp_path, task=task, overrides=small, checkpoint_every=60, log_every=60, lr=2e-3,
          log=lambda msg: None)
    model, ckpt = load_checkpoint(tmp_path)
    after = _held_out_nll(model, held_out)
    assert ckpt["task"] == "sawtooth" and model.config.dim_x == 2
    assert after < before - 0.2, (before, after)
