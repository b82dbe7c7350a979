"""The Adam training loops on fresh tasks, and the scoring around them, shared by the Intention experiments
that learn from task streams.

:func:`adam_on_stream` is the one loop (a seeded stream, so every model of a task sees the same
tasks; an optional rate schedule; a per-step callback for logging and evaluation); the others are
its uses: with evaluations (:func:`train_on_fresh_tasks`), with a mean loss logged a few times
(:func:`log_mean_loss`), and the few-shot regressors' logged MSE curve with their scores before and
after training (:func:`train_mse_curve`, :func:`scored_training`).
"""
from __future__ import annotations

import math
import time

import torch


def adam_on_stream(model, step_loss, *, steps: int, lr: float, seed: int, schedule=None, after_step=None) -> dict:
    """Adam on ``step_loss(model, gen)`` for ``steps`` steps; returns ``{"train_loss": [...], "seconds": s}``.

    ``gen`` is a generator seeded with ``seed`` from which ``step_loss`` draws its tasks, so every
    model sees the same stream. ``schedule(opt)``, if given, makes a learning-rate scheduler stepped
    after every optimiser step. ``after_step(step, losses, start)`` runs after each step with the
    losses so far and the loop's ``time.perf_counter()`` start (to log or evaluate).
    """
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = None if schedule is None else schedule(opt)
    losses, start = [], time.perf_counter()
    for step in range(1, steps + 1):
        loss = step_loss(model, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
        if after_step is not None:
            after_step(step, losses, start)
    return {"train_loss": losses, "seconds": time.perf_counter() - start}


def log_mean_loss(log, steps: int, times: int):
    """An ``after_step`` for :func:`adam_on_stream` that logs the mean of the last 50 losses about ``times``
    times over the run and at its end (nothing when ``log`` is None)."""
    def after_step(step, losses, start):
        if log is not None and (step % max(1, steps // times) == 0 or step == steps):
            log(f"  step {step}/{steps}: loss {sum(losses[-50:]) / len(losses[-50:]):.4f} "
                f"({time.perf_counter() - start:.0f} s)")

    return after_step


def model_mse(model, batch, inputs, target) -> float:
    """MSE of ``model(*inputs(batch))`` against ``target(batch)`` without gradients (a fixed evaluation batch)."""
    with torch.no_grad():
        return float((model(*inputs(batch)) - target(batch)).pow(2).mean())


def train_on_fresh_tasks(model, *, sample, inputs, target, steps: int, batch: int, lr: float, seed: int,
                         eval_batch, eval_every: int, log=None) -> dict:
    """Adam on the MSE of ``model(*inputs(tasks))`` against ``target(tasks)``, fresh tasks every step.

    ``sample(batch, generator=gen)`` draws a task batch from a generator seeded with ``seed`` (so every
    model sees the same stream); the same MSE on the fixed ``eval_batch`` is scored at step 0, every
    ``eval_every`` steps and at the end. Returns ``{"train_loss": [...], "eval": [(step, mse), ...],
    "seconds": s}``.
    """
    def step_loss(m, gen):
        tasks = sample(batch, generator=gen)
        return (m(*inputs(tasks)) - target(tasks)).pow(2).mean()

    def after_step(step, losses, start):
        if step % eval_every == 0 or step == steps:
            evals.append((step, model_mse(model, eval_batch, inputs, target)))
            if log is not None:
                log(f"  step {step}/{steps}: train MSE {sum(losses[-eval_every:]) / len(losses[-eval_every:]):.4f}, "
                    f"eval MSE {evals[-1][1]:.4f} ({time.perf_counter() - start:.0f} s)")

    evals = [(0, model_mse(model, eval_batch, inputs, target))]
    curves = adam_on_stream(model, step_loss, steps=steps, lr=lr, seed=seed, after_step=after_step)
    return {"train_loss": curves["train_loss"], "eval": evals, "seconds": curves["seconds"]}


def mse_per_context(model, eval_sets: dict) -> dict:
    """A few-shot regressor's MSE on ``eval_sets`` (number of observations -> task dict): the mean over
    tasks of each task's MSE over its targets, and its standard error over tasks, keyed by ``str(n)``."""
    out = {}
    with torch.no_grad():
        for n, t in eval_sets.items():
            per_task = ((model(t["xc"], t["yc"], t["x"]) - t["y"]) ** 2).mean(dim=(1, 2))
            out[str(n)] = {"mse": float(per_task.mean()), "sem": float(per_task.std() / math.sqrt(len(per_task)))}
    return out


def train_mse_curve(model, sample, *, steps: int, lr: float, seed: int, log_every: int, digits: int, log) -> list:
    """Adam on a few-shot regressor's MSE at ``t["y"]`` for tasks ``t = sample(gen)`` (``gen`` seeded with
    ``seed``); returns the curve of mean train MSEs over each ``log_every`` steps (and the rest at the
    end), each also logged with ``digits`` decimals."""
    curve, running, since = [], 0.0, 0

    def step_loss(m, gen):
        t = sample(gen)
        return ((m(t["xc"], t["yc"], t["x"]) - t["y"]) ** 2).mean()

    def after_step(step, losses, start):
        nonlocal running, since
        running, since = running + losses[-1], since + 1
        if step % log_every == 0 or step == steps:
            curve.append(running / since)
            running, since = 0.0, 0
            log(f"  step {step}/{steps}: train MSE {curve[-1]:.{digits}f}")

    adam_on_stream(model, step_loss, steps=steps, lr=lr, seed=seed, after_step=after_step)
    return curve


def scored_training(model, train, lr: float, eval_sets: dict, draw, drawn: str) -> dict:
    """A few-shot regressor's row of the report: :func:`mse_per_context` untrained and after
    ``train(model, lr)`` (which returns the train curve), its seconds, rate and parameters, and
    ``draw(model)`` (the figure's predictions) before and after, under the key ``drawn``."""
    before, drawn_before = mse_per_context(model, eval_sets), draw(model)
    start = time.perf_counter()
    curve = train(model, lr)
    seconds = time.perf_counter() - start
    return {"untrained": before, "trained": mse_per_context(model, eval_sets), "train_curve": curve,
            "train_seconds": seconds, "lr": lr, "parameters": sum(p.numel() for p in model.parameters()),
            drawn: {"untrained": drawn_before, "trained": draw(model)}}
