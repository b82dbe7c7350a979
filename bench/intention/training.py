"""The Adam training loop on fresh tasks shared by the Intention experiments that learn from task streams."""
from __future__ import annotations

import time


def mse_on(predict, batch, target) -> float:
    """MSE of ``predict(batch)`` against ``target(batch)`` without gradients (a fixed evaluation batch)."""
    import torch

    with torch.no_grad():
        return float((predict(batch) - target(batch)).pow(2).mean())


def train_on_fresh_tasks(model, *, sample, loss, evaluate, steps: int, batch: int, lr: float, seed: int,
                         eval_batch, eval_every: int, log=None) -> dict:
    """Adam on fresh tasks every step; returns the curves.

    ``sample(batch, generator=gen)`` draws a task batch from a generator seeded with ``seed`` (so every
    model sees the same stream), ``loss(model, tasks)`` is the scalar MSE trained, and
    ``evaluate(model, eval_batch)`` scores the fixed evaluation batch at step 0, every ``eval_every``
    steps and at the end. Returns ``{"train_loss": [...], "eval": [(step, mse), ...], "seconds": s}``.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses, evals = [], [(0, evaluate(model, eval_batch))]
    start = time.perf_counter()
    for step in range(1, steps + 1):
        value = loss(model, sample(batch, generator=gen))
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()
        losses.append(value.item())
        if step % eval_every == 0 or step == steps:
            evals.append((step, evaluate(model, eval_batch)))
            if log is not None:
                log(f"  step {step}/{steps}: train MSE {sum(losses[-eval_every:]) / len(losses[-eval_every:]):.4f}, "
                    f"eval MSE {evals[-1][1]:.4f} ({time.perf_counter() - start:.0f} s)")
    return {"train_loss": losses, "eval": evals, "seconds": time.perf_counter() - start}
