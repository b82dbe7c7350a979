"""``python -m bench train gp|sawtooth|images|wheel|copy``: seeded, resumable training of a reference NP model
(docs/spec.md §2, §6; the 2-D GP and Sawtooth tasks of the efficient-NP chapter: docs/data.md).

``gp``, ``sawtooth``, ``images`` and ``wheel`` (bandit pre-training, batches of 8) share one loop (:func:`train`)
over an :class:`bench.np.tasks.np_tasks.NPTask`:
Adam (lr 5e-4, ``--weight-decay`` 0 as in the official GP code) with a cosine schedule over
``--steps``, batches of 16 fresh tasks. Every
``--checkpoint-every`` steps (and at the end) the run directory gets ``checkpoint.pt`` (model,
optimiser, schedule, step, the task settings, the batch generator's and torch's RNG states), written
atomically, so rerunning the same command continues where it stopped and gives the same parameters
as an uninterrupted run; ``--keep-every`` also keeps step-numbered copies, from which a stretch of
the run replays exactly. Progress lines (loss, the gradient's global norm, steps/s) go to stderr and
``loss_history.csv``. ``images`` also writes ``completions.png``
(context / mean / std of a few held-out images). ``copy`` is the TCA copy task
(:mod:`bench.np.tasks.copy_cli`), a few minutes, not checkpointed.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from attn_ext.data import KERNELS, LENGTH_RANGES
from attn_ext.models import MODELS, build_model
from bench.np.checkpoint import CHECKPOINT, save_checkpoint, stored_options
from bench.np.data.images import DATASETS
from bench.np.tasks.copy_cli import add_copy_arguments, run_copy
from bench.np.tasks.image_plot import plot_run
from bench.np.tasks.np_tasks import CHAPTER_2D, gp_task, image_task, sawtooth_task, wheel_task
from bench.np.train_history import LogPoint, append_history, start_history

#: NPConfig fields settable from the command line.
CONFIG_FLAGS = ("d_model", "num_layers", "num_heads", "ff_dim", "emb_depth", "num_latents", "chunk_size")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--d-model`` … ``--chunk-size``: overrides of :class:`attn_ext.models.NPConfig`."""
    for field in CONFIG_FLAGS:
        parser.add_argument("--" + field.replace("_", "-"), type=int, default=None, dest=field,
                            help=f"model {field} (default: docs/spec.md §5)")


def _common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--out", type=Path, required=True, help="run directory (checkpoint, logs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--weight-decay", type=float, default=0.0,
                        help="Adam's L2 penalty (default 0; the CMANP paper grid-searched 0, 1e-5, 1e-4, 1e-3)")
    parser.add_argument("--clip-grad-norm", type=float, default=None, metavar="C",
                        help="scale the global gradient norm down to at most C before each step (default: no "
                             "clipping, as in the official GP code)")
    parser.add_argument("--checkpoint-every", type=int, default=1000)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--keep-every", type=int, default=None, metavar="N",
                        help="also keep the checkpoint of every N-th step as checkpoint-STEP.pt (to replay a stretch)")
    parser.add_argument("--restart", action="store_true", help="ignore an existing checkpoint in --out")
    parser.add_argument("--stop-after", type=int, default=None, metavar="N",
                        help="checkpoint and stop after N steps of this invocation (rerun to resume)")
    add_model_arguments(parser)
    parser.add_argument("--aggregator", choices=("mean", "transformer"), default=None,
                        help="retreever: node aggregator (default transformer, the paper's)")
    parser.add_argument("--block", choices=("prenorm", "perceiver", "official"), default=None,
                        help="lbanp, cmanp, cmanp_and: pre-norm blocks (default), the official code's Perceiver "
                             "blocks, or those with its projections and layers copied from one (official)")
    parser.add_argument("--intention-form", choices=("linear", "paper"), default=None,
                        help="intention_np: single-linear Intention (default) or the paper's Definition 3.1 form")
    parser.add_argument("--covariance", choices=("lowrank", "cholesky"), default=None,
                        help="cmanp_and: low-rank-plus-diagonal block covariance (default) or a Cholesky factor "
                             "as TNP-ND's (CMANP App. E.1)")
    parser.add_argument("--backprop-through-tree", dest="backprop_through_tree", action="store_true", default=None,
                        help="retreever: let the internal nodes' gradients reach the encoder (paper: bptt=False)")
    parser.add_argument("--no-backprop-through-tree", dest="backprop_through_tree", action="store_false", default=None,
                        help="retreever: detach the children in the node aggregation (the default)")
    parser.add_argument("--tree-design", choices=("kd", "random", "kd-x0", "kd-x1", "kd-rp"), default=None,
                        help="retreever: leaf order (TCA Table 6; default kd, see docs/tca_baselines.md)")
    parser.add_argument("--lambda-rl", type=float, default=None, help="retreever: weight of the RL term (paper: 1)")
    parser.add_argument("--lambda-ca", type=float, default=None,
                        help="retreever: weight of the full-cross-attention term (paper: 1)")
    parser.add_argument("--points-per-unit", type=float, default=None,
                        help="convnp: grid density (default 64; a 2-D grid holds its square per unit area)")


def add_task_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """The options that choose the task ``name`` ("gp", "sawtooth", "images" or "wheel"); shared with
    ``python -m bench eval`` (which takes the input dimension and the counts from the run)."""
    if name == "wheel":
        parser.add_argument("--num-context", type=int, default=512, help="context points per problem (paper: 512)")
        parser.add_argument("--num-target", type=int, default=50, help="target points per problem (paper: 50)")
        parser.add_argument("--context-rewards", choices=["all", "pulled"], default="all",
                            help="context y: every arm's reward (paper) or one random pulled arm's, as at deployment")
    elif name == "gp":
        parser.add_argument("--kernel", choices=KERNELS, default="rbf")
        parser.add_argument("--length-range", choices=sorted(LENGTH_RANGES), default="code")
    elif name != "sawtooth":
        parser.add_argument("--dataset", choices=list(DATASETS), required=(name == "images-train"),
                            help="emnist and celeba* read --data-dir; digits is scikit-learn's, offline")
        parser.add_argument("--data-dir", type=Path, default=None, help="directory of the dataset's files")


def _add_size_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """``--dim-x``, ``--num-context``, ``--num-target`` of the GP and Sawtooth tasks (None: the task's default)."""
    if name == "sawtooth":
        dim, context, target = "2", "64", "128"
    else:
        dim, context, target = "1", "random, U{3..46}", "random, U{3..49 - N_c}"
    parser.add_argument("--dim-x", type=int, default=None, metavar="D", help=f"input dimension (default {dim})")
    parser.add_argument("--num-context", type=int, default=None, metavar="N",
                        help=f"context points per task (default {context})")
    parser.add_argument("--num-target", type=int, default=None, metavar="N",
                        help=f"target points per task (default {target})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="task", metavar="TASK", required=True)
    gp = sub.add_parser("gp", help="GP meta-regression (docs/spec.md §6), 1-D or --dim-x D")
    _common_arguments(gp)
    add_task_arguments(gp, "gp")
    _add_size_arguments(gp, "gp")
    gp.add_argument("--chapter-2d", action="store_true",
                    help="the efficient-NP chapter's setting: --dim-x 2 --num-context 64 --num-target 128")
    sawtooth = sub.add_parser("sawtooth",
                              help="Sawtooth regression (the efficient-NP chapter's 2-D task, docs/data.md)")
    _common_arguments(sawtooth)
    add_task_arguments(sawtooth, "sawtooth")
    _add_size_arguments(sawtooth, "sawtooth")
    sawtooth.add_argument("--noise-std", type=float, default=None,
                          help="observation noise (default 0.025, docs/data.md)")
    images = sub.add_parser("images", help="image completion (EMNIST, CelebA 32/64/128, sklearn digits)")
    _common_arguments(images)
    add_task_arguments(images, "images-train")
    images.add_argument("--plot-images", type=int, default=4, help="held-out images in completions.png (0: none)")
    add_copy_arguments(sub.add_parser("copy", help="TCA copy task (retrieve the mirrored token)"))
    wheel = sub.add_parser("wheel", help="wheel-bandit pre-training (CMANP App. C.2; deploy with `python -m bench bandit`)")
    _common_arguments(wheel)
    add_task_arguments(wheel, "wheel")
    wheel.set_defaults(batch_size=8)


def model_overrides(args: argparse.Namespace) -> dict:
    return {f: getattr(args, f) for f in CONFIG_FLAGS if getattr(args, f, None) is not None}


#: Constructor options of one model (beyond NPConfig) settable from the command line.
MODEL_OPTION_FLAGS = {"retreever": ("aggregator", "backprop_through_tree", "tree_design", "lambda_rl", "lambda_ca"),
                      "lbanp": ("block",), "cmanp": ("block",),
                      "cmanp_and": ("block", "covariance"), "intention_np": ("intention_form",),
                      "convnp": ("points_per_unit",)}


def model_options(args: argparse.Namespace) -> dict:
    """The model-specific options given on the command line; an error names any the model lacks."""
    given = {f: getattr(args, f) for flags in MODEL_OPTION_FLAGS.values() for f in flags
             if getattr(args, f, None) is not None}
    allowed = MODEL_OPTION_FLAGS.get(args.model, ())
    wrong = [f for f in given if f not in allowed]
    if wrong:
        owners = {f: [m for m, flags in MODEL_OPTION_FLAGS.items() if f in flags] for f in wrong}
        raise ValueError("; ".join(f"--{f.replace('_', '-')} applies to {', '.join(owners[f])} only"
                                   for f in wrong) + f", not {args.model}")
    return given


def train(model_name: str, steps: int, out: Path, *, task=None, seed: int = 0, batch_size: int = 16,
          lr: float = 5e-4, weight_decay: float = 0.0, clip_grad_norm: Optional[float] = None,
          checkpoint_every: int = 1000, log_every: int = 100,
          restart: bool = False, keep_every: Optional[int] = None,
          overrides: Optional[dict] = None, options: Optional[dict] = None, stop_after: Optional[int] = None,
          log=None, **gp_settings) -> dict:
    """Train (or resume) a model on ``task`` (an :class:`~bench.np.tasks.np_tasks.NPTask`; default the
    GP task of ``gp_settings``, e.g. ``kernel="matern52"``); returns the summary written to ``out/train.json``.

    ``overrides`` are :class:`~attn_ext.models.NPConfig` fields, ``options`` the model's own constructor
    options (e.g. ReTreever's ``aggregator``); both are stored in the checkpoint, with the batch size,
    ``lr``, ``weight_decay`` and ``clip_grad_norm`` (the global gradient norm is scaled down to at most
    this before each step; None, the official recipe's, does not clip), and resuming with any of them
    different is an error. ``stop_after`` ends this invocation after that many steps (checkpointed),
    for time-sliced jobs; calling again resumes. ``keep_every`` also keeps the checkpoint of every multiple of that many steps as
    ``checkpoint-STEP.pt``: copied into an empty directory as ``checkpoint.pt``, it replays the run
    from that step bit for bit (the batch generator and RNG states are in it), e.g. to look at a spike.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if min(steps, batch_size, checkpoint_every, log_every, 1 if keep_every is None else keep_every) <= 0:
        raise ValueError("steps, batch_size, checkpoint_every, log_every and keep_every must be positive")
    if not lr > 0 or not weight_decay >= 0:
        raise ValueError(f"lr must be positive and weight_decay non-negative, got lr={lr}, weight_decay={weight_decay}")
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise ValueError(f"clip_grad_norm must be positive (or None: no clipping), got {clip_grad_norm}")
    task = task or gp_task(**gp_settings)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    sizes = {**(overrides or {}), "dim_x": task.dim_x, "dim_y": task.dim_y}
    model = build_model(model_name, **sizes, **(options or {}))
    options = model.options()
    optimiser = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, T_max=steps)
    generator = torch.Generator().manual_seed(seed + 1)
    step, elapsed = 0, 0.0
    ckpt_path = out / CHECKPOINT
    if ckpt_path.exists() and not restart:
        ckpt = torch.load(ckpt_path, weights_only=False)
        # The optimiser's state would silently override lr and weight decay, and another batch size or
        # config would train a different run than the one the directory names.
        asked = {"model": model_name, "steps": steps, "task": task.name, "task_settings": task.settings,
                 "model_options": options, "config": model.config.to_dict(), "batch_size": batch_size, "lr": lr,
                 "weight_decay": weight_decay, "clip_grad_norm": clip_grad_norm}
        found = {"model": ckpt["model"], "steps": ckpt["steps"], "task": ckpt.get("task", "gp"),
                 "task_settings": ckpt.get("task_settings", task.settings), "model_options": stored_options(ckpt),
                 "config": ckpt.get("config", asked["config"]), "batch_size": ckpt.get("batch_size", batch_size),
                 "lr": ckpt.get("lr", lr), "weight_decay": ckpt.get("weight_decay", 0.0),
                 "clip_grad_norm": ckpt.get("clip_grad_norm")}
        differ = [key for key in asked if asked[key] != found[key]]
        if differ:
            raise ValueError(f"{ckpt_path} was trained with "
                             + ", ".join(f"{key}={found[key]!r}" for key in differ) + "; asked for "
                             + ", ".join(f"{key}={asked[key]!r}" for key in differ)
                             + ": use another --out or --restart")
        model.load_state_dict(ckpt["model_state"])
        optimiser.load_state_dict(ckpt["optimiser"])
        schedule.load_state_dict(ckpt["schedule"])
        generator.set_state(ckpt["generator"])
        torch.set_rng_state(ckpt["torch_rng"])
        step, elapsed = ckpt["step"], ckpt["elapsed"]
        log(f"resumed {model_name} from {ckpt_path} at step {step}/{steps}")
    start_history(out, step)
    # The task settings also sit at the top level (kernel, dataset, ...), where `eval` looks first.
    meta = {"model": model_name, "config": model.config.to_dict(), "model_options": options, "steps": steps,
            "task": task.name, "task_settings": task.settings, **task.settings, "seed": seed,
            "batch_size": batch_size, "lr": lr, "weight_decay": weight_decay, "clip_grad_norm": clip_grad_norm}

    def checkpoint() -> None:
        save_checkpoint(ckpt_path, {**meta, "model_state": model.state_dict(), "optimiser": optimiser.state_dict(),
                                    "schedule": schedule.state_dict(), "generator": generator.get_state(),
                                    "torch_rng": torch.get_rng_state(), "step": step, "elapsed": elapsed})

    model.train()
    parameters = [p for p in model.parameters() if p.requires_grad]
    window, norms, window_start, t0, last = [], [], time.perf_counter(), time.perf_counter(), None
    end = steps if stop_after is None else min(steps, step + stop_after)
    while step < end:
        loss = model(task.sample(batch_size, generator))
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{model_name}: loss {loss.item()} at step {step}")
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        if clip_grad_norm is None:
            norms.append(gradient_norm(parameters))
        else:  # logged before clipping, so that the log still shows the spikes
            norms.append(torch.nn.utils.clip_grad_norm_(parameters, clip_grad_norm).item())
        optimiser.step()
        schedule.step()
        step += 1
        last = loss.item()
        window.append(last)
        if step % log_every == 0 or step == steps:
            now = time.perf_counter()
            rate = len(window) / max(now - window_start, 1e-9)
            eta = (steps - step) / rate
            point = LogPoint(step, sum(window) / len(window), schedule.get_last_lr()[0], rate,
                             sum(norms) / len(norms), max(norms))
            append_history(out, point)
            log(f"[{model_name}] step {step}/{steps} loss {point.loss:.4f} |grad| {point.grad_norm:.3g} "
                f"(max {point.grad_norm_max:.3g}) {rate:.2f} steps/s lr {point.lr:.2e} eta {eta / 60:.1f} min")
            window, norms, window_start = [], [], now
        kept = keep_every is not None and step % keep_every == 0
        if step % checkpoint_every == 0 or step == end or kept:
            elapsed += time.perf_counter() - t0
            t0 = time.perf_counter()
            checkpoint()
            if kept:
                shutil.copyfile(ckpt_path, out / f"checkpoint-{step:06d}.pt")
    summary = {**meta, "final_step": step, "train_seconds": round(elapsed, 1), "last_loss": last}
    (out / "train.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def gradient_norm(parameters) -> float:
    """The global L2 norm of the parameters' gradients (parameters without one count as zero)."""
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    # One fused call per dtype, as clip_grad_norm_ does: a per-tensor loop cost 2% of a TNP-D step.
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))).item()


def task_from_arguments(args: argparse.Namespace):
    """The :class:`~bench.np.tasks.np_tasks.NPTask` that ``python -m bench train TASK ...`` names."""
    if args.task in ("gp", "sawtooth"):
        chapter = args.task == "sawtooth" or args.chapter_2d
        preset = CHAPTER_2D if chapter else {"dim_x": 1, "num_context": None, "num_target": None}
        sizes = {k: v if getattr(args, k) is None else getattr(args, k) for k, v in preset.items()}
        if args.task == "gp":
            return gp_task(args.kernel, args.length_range, **sizes)
        return sawtooth_task(**sizes, noise_std=args.noise_std)
    if args.task == "images":
        return image_task(args.dataset, args.data_dir)
    return wheel_task(args.num_context, args.num_target, args.context_rewards)


def run(args: argparse.Namespace) -> int:
    if args.task == "copy":
        return run_copy(args)
    torch.set_num_threads(args.threads)
    try:
        task = task_from_arguments(args)
        summary = train(args.model, args.steps, args.out, task=task, seed=args.seed, batch_size=args.batch_size,
                        lr=args.lr, weight_decay=args.weight_decay,
                        clip_grad_norm=args.clip_grad_norm, checkpoint_every=args.checkpoint_every,
                        log_every=args.log_every, restart=args.restart, keep_every=args.keep_every,
                        overrides=model_overrides(args),
                        options=model_options(args), stop_after=args.stop_after)
        if args.task == "images" and args.plot_images > 0:
            summary["figure"] = str(plot_run(args.out, args.plot_images))
    except (ValueError, FloatingPointError, FileNotFoundError, ImportError) as exc:
        print(f"python -m bench train: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({k: summary[k] for k in ("model", "task", "final_step", "train_seconds", "figure")
                      if k in summary}))
    return 0
