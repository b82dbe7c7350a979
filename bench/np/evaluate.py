"""``python -m bench eval gp|sawtooth|images``: mean per-target log-likelihood of a trained model on fixed-seed tasks.

The metric is docs/spec.md §6's: per task, the mean over targets of the Gaussian log-likelihood summed over
y dimensions; reported as mean ± std over the evaluation batches (each batch's value is the mean
over its tasks). CMANP-AND is scored block-autoregressively (``--block-size``, CMANP App. C.2).

``gp``: the cached GP evaluation set (3000 batches of 16) of the run's input dimension and counts;
writes ``eval_<kernel>.json`` (1-D, random counts: the set of docs/spec.md §6) or, for any other
setting, ``eval_<kernel>_dim<D>_nc<N>_nt<N>.json``, which the 1-D GP report does not read.
``sawtooth``: the cached Sawtooth evaluation set of the run's settings (docs/data.md); writes
``eval_sawtooth_dim<D>_nc<N>_nt<N>.json``.
``images``: every image of each evaluation split (EMNIST seen/unseen, CelebA test, digits test) in
order, batches of 16, context/target splits drawn from seed 0; writes ``eval_<dataset>_<split>.json``
and ``completions_<split>.png`` into the run directory.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Iterable, Optional

import torch

from attn_ext.models import CMANPAND
from bench.np.checkpoint import load_checkpoint, stored_options
from bench.np.data.eval_set import FULL_NUM_BATCHES, evaluation_set, sawtooth_evaluation_set
from bench.np.data.images import DATASETS
from bench.np.tasks.image_plot import plot_completions
from bench.np.tasks.np_tasks import image_task
from bench.np.train import add_task_arguments

EVAL_BATCH, EVAL_SEED = 16, 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="task", metavar="TASK", required=True)
    gp = sub.add_parser("gp", help="the fixed-seed GP evaluation set")
    sawtooth = sub.add_parser("sawtooth", help="the fixed-seed Sawtooth evaluation set")
    images = sub.add_parser("images", help="the evaluation splits of the run's image dataset")
    for p in (gp, sawtooth, images):
        p.add_argument("--ckpt", type=Path, required=True, help="run directory of `python -m bench train` or a checkpoint file")
        p.add_argument("--block-size", type=int, default=None, help="b_Q of CMANP-AND (default: the model's, 5)")
        p.add_argument("--threads", type=int, default=1)
    add_task_arguments(gp, "gp")
    for p in (gp, sawtooth):
        p.add_argument("--num-batches", type=int, default=FULL_NUM_BATCHES,
                       help=f"evaluation batches of 16 (default {FULL_NUM_BATCHES}, the full protocol)")
        p.add_argument("--data-dir", type=Path, default=None,
                       help="cache of the evaluation set (default $ATTN_EXT_DATA or ~/.cache/attn_ext)")
        for which in ("context", "target"):
            p.add_argument(f"--num-{which}", type=int, default=None, metavar="N",
                           help=f"{which} points per task (default: the run's; the input dimension is always "
                                "the run's)")
    add_task_arguments(images, "images")
    images.add_argument("--split", default=None, help="one evaluation split (default: all of the dataset's)")
    images.add_argument("--num-batches", type=int, default=None, help="at most this many batches of 16 per split")
    images.add_argument("--plot-images", type=int, default=4, help="images in completions_<split>.png (0: none)")


def score(model, batches: Iterable, block_size: Optional[int] = None):
    """``(per-batch mean log-likelihood [num_batches], seconds, extra result fields)``."""
    model.eval()
    kwargs = {"block_size": block_size} if isinstance(model, CMANPAND) else {}
    start = time.perf_counter()
    with torch.no_grad():
        per_batch = torch.stack([model.log_likelihood(b, **kwargs).mean() for b in batches])
    extra = {"block_size": block_size or model.block_size} if kwargs else {}
    return per_batch, round(time.perf_counter() - start, 1), extra


def _result(ckpt: dict, per_batch, seconds: float, extra: dict, **fields) -> dict:
    return {"model": ckpt["model"], "model_options": stored_options(ckpt), **fields, "num_batches": len(per_batch),
            "train_steps": ckpt["step"],
            "schedule_steps": ckpt.get("steps", ckpt["step"]), "train_seconds": ckpt["elapsed"],
            "log_likelihood_mean": per_batch.mean().item(),
            "log_likelihood_std": per_batch.std().item() if len(per_batch) > 1 else 0.0,
            "eval_seconds": seconds, **extra}


def _out_dir(run_dir: Path) -> Path:
    return run_dir if run_dir.is_dir() else run_dir.parent


def _run_task(run_dir: Path, task: str, num_context: Optional[int], num_target: Optional[int]):
    """``(model, checkpoint, the run's task settings with the counts overridden)``; a run of another task
    is an error (checkpoints from before tasks were stored are GP runs)."""
    model, ckpt = load_checkpoint(run_dir)
    if ckpt.get("task", "gp") != task:
        raise ValueError(f"{run_dir} is a {ckpt.get('task', 'gp')!r} run; `eval {task}` needs a {task} run")
    settings = dict(ckpt.get("task_settings", {}))
    settings.update({k: v for k, v in (("num_context", num_context), ("num_target", num_target)) if v is not None})
    return model, ckpt, settings


def _sizes_tag(settings: dict) -> str:
    return "dim{}_nc{}_nt{}".format(settings.get("dim_x", 1), settings.get("num_context") or "rand",
                                    settings.get("num_target") or "rand")


def evaluate(run_dir: Path, kernel: str = "rbf", *, num_batches: int = FULL_NUM_BATCHES,
             length_range: str = "code", block_size: Optional[int] = None, data_dir: Optional[Path] = None,
             num_context: Optional[int] = None, num_target: Optional[int] = None) -> dict:
    """Evaluate a GP checkpoint on the set of its input dimension and counts (``num_context``/``num_target``
    override the run's); returns (and writes next to it) the result dict."""
    model, ckpt, settings = _run_task(run_dir, "gp", num_context, num_target)
    dim_x, nc, nt = settings.get("dim_x", 1), settings.get("num_context"), settings.get("num_target")
    batches = evaluation_set(kernel, num_batches, length_range=length_range, dim_x=dim_x, num_context=nc,
                             num_target=nt, cache_dir=data_dir)
    per_batch, seconds, extra = score(model, batches, block_size)
    result = _result(ckpt, per_batch, seconds, extra, kernel=kernel, length_range=length_range,
                     batch_size=batches[0].xc.shape[0], dim_x=dim_x, num_context=nc, num_target=nt)
    default = dim_x == 1 and nc is None and nt is None  # the name the 1-D GP report reads
    name = f"eval_{kernel}.json" if default else f"eval_{kernel}_{_sizes_tag(settings)}.json"
    (_out_dir(run_dir) / name).write_text(json.dumps(result, indent=2) + "\n")
    return result


def evaluate_sawtooth(run_dir: Path, *, num_batches: int = FULL_NUM_BATCHES, block_size: Optional[int] = None,
                      data_dir: Optional[Path] = None, num_context: Optional[int] = None,
                      num_target: Optional[int] = None) -> dict:
    """Evaluate a Sawtooth checkpoint on the fixed-seed set of its settings; returns (and writes) the result."""
    model, ckpt, settings = _run_task(run_dir, "sawtooth", num_context, num_target)
    batches = sawtooth_evaluation_set(num_batches, dim_x=settings["dim_x"], num_context=settings["num_context"],
                                      num_target=settings["num_target"], noise_std=settings["noise_std"],
                                      cache_dir=data_dir)
    per_batch, seconds, extra = score(model, batches, block_size)
    result = _result(ckpt, per_batch, seconds, extra, **settings, batch_size=batches[0].xc.shape[0])
    (_out_dir(run_dir) / f"eval_sawtooth_{_sizes_tag(settings)}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def image_batches(sampler, num_batches: Optional[int] = None, seed: int = EVAL_SEED):
    """The fixed evaluation tasks of an image split: its images in order, batches of 16, seeded splits."""
    generator = torch.Generator().manual_seed(seed)
    stops = range(0, len(sampler), EVAL_BATCH)
    for lo in list(stops)[:num_batches]:
        yield sampler.tasks(sampler.images[lo:lo + EVAL_BATCH], generator)


def evaluate_images(run_dir: Path, *, dataset: Optional[str] = None, data_dir: Optional[Path] = None,
                    split: Optional[str] = None, num_batches: Optional[int] = None, block_size: Optional[int] = None,
                    plot_images: int = 4) -> list:
    """Evaluate an image-completion checkpoint on each evaluation split; one result dict per split."""
    model, ckpt = load_checkpoint(run_dir)
    if ckpt.get("task") != "images" and dataset is None:
        raise ValueError(f"{run_dir} is a {ckpt.get('task', 'gp')!r} run; `eval images` needs an image-completion run")
    dataset = dataset or ckpt["dataset"]
    data_dir = data_dir or (Path(ckpt["data_dir"]) if ckpt.get("data_dir") else None)
    results = []
    for name in [split] if split else DATASETS[dataset].eval_splits:
        sampler = image_task(dataset, data_dir, name).sampler
        per_batch, seconds, extra = score(model, image_batches(sampler, num_batches), block_size)
        result = _result(ckpt, per_batch, seconds, extra, dataset=dataset, split=name, batch_size=EVAL_BATCH)
        if plot_images > 0:
            path = _out_dir(run_dir) / f"completions_{name}.png"
            result["figure"] = str(plot_completions(model, sampler, path, plot_images))
        (_out_dir(run_dir) / f"eval_{dataset}_{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        results.append(result)
    return results


def _describe(task: str, result: dict) -> str:
    """What was evaluated, for the summary line: ``rbf``, ``rbf (dim_x 2, N_c 64, N_t 128)``, ``emnist seen``."""
    if task == "images":
        return f"{result['dataset']} {result['split']}"
    sizes = ", ".join(f"{label} {result[key]}" for key, label in (("num_context", "N_c"), ("num_target", "N_t"))
                      if result.get(key) is not None)
    dim = f"dim_x {result['dim_x']}" if task == "sawtooth" or result["dim_x"] != 1 else ""
    details = ", ".join(part for part in (dim, sizes) if part)
    name = result["kernel"] if task == "gp" else "sawtooth"
    return name + (f" ({details})" if details else "")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    try:
        if args.task == "gp":
            results = [evaluate(args.ckpt, args.kernel, num_batches=args.num_batches, length_range=args.length_range,
                                block_size=args.block_size, data_dir=args.data_dir, num_context=args.num_context,
                                num_target=args.num_target)]
        elif args.task == "sawtooth":
            results = [evaluate_sawtooth(args.ckpt, num_batches=args.num_batches, block_size=args.block_size,
                                         data_dir=args.data_dir, num_context=args.num_context,
                                         num_target=args.num_target)]
        else:
            results = evaluate_images(args.ckpt, dataset=args.dataset, data_dir=args.data_dir, split=args.split,
                                      num_batches=args.num_batches, block_size=args.block_size,
                                      plot_images=args.plot_images)
    except (FileNotFoundError, ValueError, ImportError) as exc:
        print(f"python -m bench eval: error: {exc}", file=sys.stderr)
        return 1
    for r in results:
        what = _describe(args.task, r)
        print(f"{r['model']} {what}: log-likelihood {r['log_likelihood_mean']:.3f} ± {r['log_likelihood_std']:.3f} "
              f"over {r['num_batches']} batches of {r['batch_size']} (after {r['train_steps']} steps)")
    return 0
