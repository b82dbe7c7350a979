"""Figs. 6–7: few-shot sine regression, MSE vs number of observations, before and after training.

The Intention paper (§5.1, appendix §4.1) follows MAML's sine task: each task is
``y = a·sin(x − b)`` with ``a ~ U(0.1, 5)``, ``b ~ U(0, π)``, ``M = 200`` points ``x ~ U(-6, 6)``, of
which ``N = 10`` are given as context (keys and values) and all 200 are targets. Intention,
σIntention, Attention, a Neural Process and MAML (:mod:`bench.intention.sine_models`) are trained
with the MSE of their predictions, batch 8, and scored by the MSE over a fixed evaluation set for
several N, both at initialisation (the paper's dashed curves) and after training (solid). The
paper trains 50 000 steps with layers of 128–2000 units; this task trains ``--steps`` steps at
``--width`` units.
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from bench.harness.machine import load_average, machine_info
from bench.harness.report import progress, publish
from bench.intention import command_line
from bench.intention.sine_models import SINE_MODELS, build_sine_model
from bench.intention.sine_report import plot, tables
from bench.intention.training import mse_per_context as evaluate  # this task's score (MSE per N), for callers
from bench.intention.training import scored_training, train_mse_curve

NAME = "intention_sine_few_shot"
AMPLITUDE_RANGE, PHASE_RANGE, X_RANGE = (0.1, 5.0), (0.0, math.pi), (-6.0, 6.0)
#: The paper's learning rates (Adam), tuned for 50 000 steps; see ``--lr``.
PAPER_LR = {"intention": 3e-4, "sigma_intention": 3e-4, "attention": 1e-4, "np": 1e-4, "maml": 3e-3}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bench/out", help="directory for the report files (default: bench/out)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the training tasks (default: 0)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--models", default="intention,sigma_intention,attention,np,maml",
                        help="comma-separated models (default: all five of the paper)")
    parser.add_argument("--steps", type=int, default=2000, help="training steps per model (paper: 50000; default 2000)")
    parser.add_argument("--batch", type=int, default=8, help="tasks per step (paper: 8)")
    parser.add_argument("--num-points", type=int, default=200, help="points per task, all targets (paper: 200)")
    parser.add_argument("--train-context", type=int, default=10, help="context points in training (paper: 10)")
    parser.add_argument("--eval-context", default="2,5,10,20,50", help="numbers of observations evaluated")
    parser.add_argument("--eval-tasks", type=int, default=128, help="tasks of the fixed evaluation set (default: 128)")
    parser.add_argument("--width", type=int, default=64, help="hidden width of every MLP (paper: 128 to 2000)")
    parser.add_argument("--lr", type=float, default=1e-3,
                        help="Adam rate of the amortised models (paper: 3e-4/1e-4 over 50000 steps; default 1e-3); "
                             "MAML keeps the paper's outer 3e-3")
    parser.add_argument("--alpha-init", type=float, default=0.01, help="Intention's starting ridge α (learned)")
    parser.add_argument("--sigma-scale-init", type=float, default=10.0,
                        help="σIntention's starting score scale (learned; default 10)")
    parser.add_argument("--maml-lr", type=float, default=0.01,
                        help="MAML's inner rate (paper: 0.1, which diverged here; default 0.01, MAML's own)")


def sample_sine_tasks(batch: int, num_points: int, num_context: int, generator) -> dict:
    """Draw ``batch`` sine tasks of the paper (float32 tensors).

    Returns
    -------
    dict
        ``xc, yc [B, N, 1]`` (the first ``num_context`` points: the x are i.i.d., so any N of them are a
        uniformly random subset), ``x, y [B, M, 1]`` (all points, the targets), ``amplitude, phase [B]``.

    Examples
    --------
    >>> import torch
    >>> t = sample_sine_tasks(4, 200, 10, torch.Generator().manual_seed(0))
    >>> tuple(t["xc"].shape), tuple(t["y"].shape)
    ((4, 10, 1), (4, 200, 1))
    """
    if not 1 <= num_context <= num_points or batch < 1:
        raise ValueError(f"sample_sine_tasks: need batch >= 1 and 1 <= num_context <= num_points, got batch={batch}, "
                         f"num_context={num_context}, num_points={num_points}")
    amplitude = torch.empty(batch).uniform_(*AMPLITUDE_RANGE, generator=generator)
    phase = torch.empty(batch).uniform_(*PHASE_RANGE, generator=generator)
    x = torch.empty(batch, num_points, 1).uniform_(*X_RANGE, generator=generator)
    y = amplitude.view(-1, 1, 1) * torch.sin(x - phase.view(-1, 1, 1))
    return {"xc": x[:, :num_context], "yc": y[:, :num_context], "x": x, "y": y, "amplitude": amplitude, "phase": phase}


def train(model, steps: int, lr: float, args, log_every: int = 250) -> list:
    """Adam on the paper's MSE, the same task stream (seed ``args.seed``) for every model; returns the loss
    curve (mean of each ``log_every`` steps)."""
    return train_mse_curve(model, lambda gen: sample_sine_tasks(args.batch, args.num_points, args.train_context, gen),
                           steps=steps, lr=lr, seed=args.seed, log_every=log_every, digits=3, log=progress)


def qualitative(model, task: dict, contexts, grid) -> dict:
    """Fig. 6's curves: predictions on a sorted grid of one task for each number of observations."""
    with torch.no_grad():
        return {str(n): model(task["x"][:, :n], task["y"][:, :n], grid).view(-1).tolist() for n in contexts}


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    contexts = [int(n) for n in args.eval_context.split(",")]
    unknown = [m for m in models if m not in SINE_MODELS]
    if unknown or not models or args.steps < 1 or any(not 1 <= n <= args.num_points for n in contexts):
        raise ValueError(f"sine_few_shot: bad options: models {models} (unknown: {unknown}; expected among "
                         f"{list(SINE_MODELS)}), steps {args.steps}, eval contexts {contexts} for "
                         f"{args.num_points} points")
    start = time.perf_counter()
    machine = machine_info()
    eval_gen = torch.Generator().manual_seed(10_000 + args.seed)  # evaluation tasks never seen in training
    base = sample_sine_tasks(args.eval_tasks, args.num_points, 1, eval_gen)
    eval_sets = {n: {**base, "xc": base["x"][:, :n], "yc": base["y"][:, :n]} for n in contexts}
    show = {k: v[:1] for k, v in base.items()}  # the task drawn in the Fig. 6 panels
    grid = torch.linspace(*X_RANGE, 200).view(1, -1, 1)
    rows = {}
    for name in models:
        torch.manual_seed(args.seed)
        model = build_sine_model(name, args.width, alpha_init=args.alpha_init, sigma_scale_init=args.sigma_scale_init,
                                 maml_lr=args.maml_lr)
        lr = PAPER_LR["maml"] if name == "maml" else args.lr
        progress(f"sine_few_shot: {name} ({sum(p.numel() for p in model.parameters()):,} parameters, lr {lr:g})")
        rows[name] = scored_training(model, lambda m, rate: train(m, args.steps, rate, args), lr, eval_sets,
                                     lambda m: qualitative(m, show, contexts, grid), "curves")
        progress(f"  {rows[name]['train_seconds']:.0f} s; eval MSE at N={contexts[-1]}: "
                 f"{rows[name]['trained'][str(contexts[-1])]['mse']:.3f}")
    machine["load_average_end"] = load_average()
    result = {
        "benchmark": NAME, "machine": machine, "wall_seconds": time.perf_counter() - start,
        "config": {**{k: getattr(args, k) for k in ("seed", "steps", "batch", "num_points", "train_context",
                                                     "eval_tasks", "width", "lr", "alpha_init", "sigma_scale_init",
                                                     "maml_lr", "threads")},
                   "models": models, "eval_context": contexts,
                   "command": command_line("sine_few_shot", args)},
        "rows": rows,
        "figure_task": {"x": show["x"].view(-1).tolist(), "y": show["y"].view(-1).tolist(),
                        "amplitude": float(show["amplitude"][0]), "phase": float(show["phase"][0]),
                        "grid": grid.view(-1).tolist()},
    }
    publish(NAME, tables(result), result, Path(args.out), plot)
    return 0
