"""Figs. 7 and 13: image completion as few-shot regression, MSE vs number of observed pixels (offline glyphs).

The Intention paper (§5.1, appendix §4.2) regresses MNIST intensities: 264 random pixels of an image
are the context (positions as keys, intensities as values) and every pixel is a target; the sine
task's five models (:mod:`bench.intention.image_models`, with a positional encoding of the
positions) are trained on the MSE and scored, before and after training, for several numbers of
observed pixels. MNIST cannot be downloaded here, so the images are procedurally drawn digit-like
glyphs (:mod:`bench.intention.image_glyphs`), 28 × 28 like MNIST. The paper trains 50 000 steps of
wide layers; this task trains ``--steps`` steps at ``--width`` units.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.harness.machine import load_average, machine_info
from bench.harness.report import progress, publish
from bench.intention import command_line
from bench.intention.image_bank import ImageBank
from bench.intention.image_glyphs import pixel_tasks, sample_glyphs
from bench.intention.image_models import IMAGE_MODELS, build_image_model
from bench.intention.image_report import plot, tables
from bench.intention.training import mse_per_context as evaluate  # this task's score (MSE per N), for callers
from bench.intention.training import scored_training, train_mse_curve

NAME = "intention_image_regression"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bench/out", help="directory for the report files (default: bench/out)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the training images (default: 0)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--models", default="intention,sigma_intention,attention,np,maml",
                        help="comma-separated models (default: all five of the paper)")
    parser.add_argument("--steps", type=int, default=600, help="training steps per model (paper: 50000; default 600)")
    parser.add_argument("--batch", type=int, default=8, help="images per step (paper: 1 image per iteration)")
    parser.add_argument("--side", type=int, default=28, help="image side in pixels (MNIST: 28)")
    parser.add_argument("--train-context", type=int, default=264, help="observed pixels in training (paper: 264)")
    parser.add_argument("--eval-context", default="10,30,100,264,500", help="numbers of observed pixels evaluated")
    parser.add_argument("--eval-images", type=int, default=64, help="images of the fixed evaluation set (default: 64)")
    parser.add_argument("--width", type=int, default=64, help="hidden width of every MLP (paper: 128 to 2000)")
    parser.add_argument("--frequencies", type=int, default=4, help="octaves of the Fourier positional encoding")
    parser.add_argument("--lr", type=float, default=1e-3,
                        help="Adam rate of the amortised models (paper: 3e-4/1e-4 over 50000 steps; default 1e-3); "
                             "MAML keeps the paper's outer 3e-3")
    parser.add_argument("--alpha-init", type=float, default=0.01, help="Intention's starting ridge α (learned)")
    parser.add_argument("--sigma-scale-init", type=float, default=10.0, help="σIntention's starting score scale")
    parser.add_argument("--maml-lr", type=float, default=0.01, help="MAML's inner rate (paper: 0.1; default 0.01)")
    parser.add_argument("--images", type=Path, default=None,
                        help="a torch.save'd {'train': [n, side, side], 'test': [m, side, side]} of real images "
                             "(e.g. MNIST, uint8 or [0, 1]) to use instead of the procedural glyphs; sets --side")


def glyph_images(side: int):
    """``draw(batch, generator) -> [batch, side, side]``: the procedural glyphs, the default training images."""
    return lambda batch, gen: sample_glyphs(batch, side, gen)["images"]


def train(model, steps: int, lr: float, args, log_every: int = 100, draw=None) -> list:
    """Adam on the MSE of all pixels given ``args.train_context`` random ones, the same image stream (seed
    ``args.seed``) for every model; images from ``draw(batch, generator)`` (default: the glyphs of side
    ``args.side``); returns the logged loss curve."""
    draw = draw or glyph_images(args.side)

    def sample(gen):
        return pixel_tasks(draw(args.batch, gen), args.train_context, gen)

    return train_mse_curve(model, sample, steps=steps, lr=lr, seed=args.seed, log_every=log_every, digits=4,
                           log=progress)


def completions(model, show: dict) -> dict:
    """Fig. 13's images: the predicted intensities of the shown images for each number of observations."""
    with torch.no_grad():
        return {n: model(t["xc"], t["yc"], t["x"]).squeeze(-1).tolist() for n, t in show.items()}


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    contexts = [int(n) for n in args.eval_context.split(",")]
    bank = None if args.images is None else ImageBank.load(args.images)
    if bank is not None:
        args.side = bank.side
    pixels = args.side ** 2
    unknown = [m for m in models if m not in IMAGE_MODELS]
    if (unknown or not models or args.steps < 1 or args.eval_images < 2 or not 1 <= args.train_context <= pixels
            or any(not 1 <= n <= pixels for n in contexts)):
        raise ValueError(f"image_regression: bad options: models {models} (unknown: {unknown}; expected among "
                         f"{list(IMAGE_MODELS)}), steps {args.steps}, eval images {args.eval_images}, train context "
                         f"{args.train_context} and eval contexts {contexts} for {pixels} pixels")
    start = time.perf_counter()
    machine = machine_info()
    eval_gen = torch.Generator().manual_seed(10_000 + args.seed)  # evaluation images never seen in training
    images = (sample_glyphs(args.eval_images, args.side, eval_gen)["images"] if bank is None
              else bank.evaluation(args.eval_images))
    full = pixel_tasks(images, pixels, eval_gen)  # one random pixel order per image: N observed = its first N
    eval_sets = {n: {**full, "xc": full["xc"][:, :n], "yc": full["yc"][:, :n]} for n in contexts}
    show_count = min(2, args.eval_images)
    show = {str(n): {k: v[:show_count] for k, v in t.items()} for n, t in eval_sets.items()}
    rows = {}
    for name in models:
        torch.manual_seed(args.seed)
        model = build_image_model(name, args.width, frequencies=args.frequencies, alpha_init=args.alpha_init,
                                  sigma_scale_init=args.sigma_scale_init, maml_lr=args.maml_lr)
        lr = 3e-3 if name == "maml" else args.lr
        progress(f"image_regression: {name} ({sum(p.numel() for p in model.parameters()):,} parameters, lr {lr:g})")
        draw = None if bank is None else bank.sample
        rows[name] = scored_training(model, lambda m, rate: train(m, args.steps, rate, args, draw=draw), lr, eval_sets,
                                     lambda m: completions(m, show), "completions")
        progress(f"  {rows[name]['train_seconds']:.0f} s; eval MSE at N={contexts[-1]}: "
                 f"{rows[name]['trained'][str(contexts[-1])]['mse']:.4f}")
    machine["load_average_end"] = load_average()
    result = {
        "benchmark": NAME, "machine": machine, "wall_seconds": time.perf_counter() - start,
        "config": {**{k: getattr(args, k) for k in ("seed", "steps", "batch", "side", "train_context", "eval_images",
                                                     "width", "frequencies", "lr", "alpha_init", "sigma_scale_init",
                                                     "maml_lr", "threads")},
                   "models": models, "eval_context": contexts, "data": None if bank is None else bank.describe(),
                   "command": command_line("image_regression", args)},
        "pixel_variance": float(images.var()), "pixel_mean": float(images.mean()),
        "rows": rows,
        "figure_images": {"truth": images[:show_count].tolist(),
                          "pixel_order": full["index"][:show_count].tolist()},  # the first N are observed
    }
    publish(NAME, tables(result), result, Path(args.out), plot)
    return 0
