"""``python -m bench eval gp|images``: mean per-target log-likelihood of a trained model on fixed-seed tasks.

The metric is docs/spec.md §6's: per task, the mean over targets of the Gaussian log-likelihood summed over
y dimensions; reported as mean ± std over the evaluation batches (each batch's value is the mean
over its tasks). CMANP-AND is scored block-autoregressively (``--block-size``, CMANP App. C.2).

``gp``: the cached GP evaluation set (3000 batches of 16); writes ``eval_<kernel>.json``.
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

from bench.np.data.eval_set import FULL_NUM_BATCHES

EVAL_BATCH, EVAL_SEED = 16, 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bench.np.train import add_task_arguments

    sub = parser.add_subparsers(dest="task", metavar="TASK", required=True)
    gp = sub.add_parser("gp", help="the fixed-seed GP evaluation set")
    images = sub.add_parser("images", help="the evaluation splits of the run's image dataset")
    for p in (gp, images):
        p.add_argument("--ckpt", type=Path, required=True, help="run directory of `python -m bench train` or a checkpoint file")
        p.add_argument("--block-size", type=int, default=None, help="b_Q of CMANP-AND (default: the model's, 5)")
        p.add_argument("--threads", type=int, default=1)
    gp.add_argument("--num-batches", type=int, default=FULL_NUM_BATCHES,
                    help=f"evaluation batches of 16 (default {FULL_NUM_BATCHES}, the full protocol)")
    add_task_arguments(gp, "gp")
    gp.add_argument("--data-dir", type=Path, default=None,
                    help="cache of the evaluation set (default $ATTN_EXT_DATA or ~/.cache/attn_ext)")
    add_task_arguments(images, "images")
    images.add_argument("--split", default=None, help="one evaluation split (default: all of the dataset's)")
    images.add_argument("--num-batches", type=int, default=None, help="at most this many batches of 16 per split")
    images.add_argument("--plot-images", type=int, default=4, help="images in completions_<split>.png (0: none)")


def score(model, batches: Iterable, block_size: Optional[int] = None):
    """``(per-batch mean log-likelihood [num_batches], seconds, extra result fields)``."""
    import torch

    from attn_ext.models import CMANPAND

    model.eval()
    kwargs = {"block_size": block_size} if isinstance(model, CMANPAND) else {}
    start = time.perf_counter()
    with torch.no_grad():
        per_batch = torch.stack([model.log_likelihood(b, **kwargs).mean() for b in batches])
    extra = {"block_size": block_size or model.block_size} if kwargs else {}
    return per_batch, round(time.perf_counter() - start, 1), extra


def _result(ckpt: dict, per_batch, seconds: float, extra: dict, **fields) -> dict:
    from bench.np.train import stored_options

    return {"model": ckpt["model"], "model_options": stored_options(ckpt), **fields, "num_batches": len(per_batch),
            "train_steps": ckpt["step"],
            "schedule_steps": ckpt.get("steps", ckpt["step"]), "train_seconds": ckpt["elapsed"],
            "log_likelihood_mean": per_batch.mean().item(),
            "log_likelihood_std": per_batch.std().item() if len(per_batch) > 1 else 0.0,
            "eval_seconds": seconds, **extra}


def _out_dir(run_dir: Path) -> Path:
    return run_dir if run_dir.is_dir() else run_dir.parent


def evaluate(run_dir: Path, kernel: str = "rbf", *, num_batches: int = FULL_NUM_BATCHES,
             length_range: str = "code", block_size: Optional[int] = None, data_dir: Optional[Path] = None) -> dict:
    """Evaluate a GP checkpoint; returns (and writes next to it) the result dict."""
    from bench.np.data.eval_set import evaluation_set
    from bench.np.train import load_checkpoint

    model, ckpt = load_checkpoint(run_dir)
    batches = evaluation_set(kernel, num_batches, length_range=length_range, cache_dir=data_dir)
    per_batch, seconds, extra = score(model, batches, block_size)
    result = _result(ckpt, per_batch, seconds, extra, kernel=kernel, length_range=length_range,
                     batch_size=batches[0].xc.shape[0])
    (_out_dir(run_dir) / f"eval_{kernel}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def image_batches(sampler, num_batches: Optional[int] = None, seed: int = EVAL_SEED):
    """The fixed evaluation tasks of an image split: its images in order, batches of 16, seeded splits."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    stops = range(0, len(sampler), EVAL_BATCH)
    for lo in list(stops)[:num_batches]:
        yield sampler.tasks(sampler.images[lo:lo + EVAL_BATCH], generator)


def evaluate_images(run_dir: Path, *, dataset: Optional[str] = None, data_dir: Optional[Path] = None,
                    split: Optional[str] = None, num_batches: Optional[int] = None, block_size: Optional[int] = None,
                    plot_images: int = 4) -> list:
    """Evaluate an image-completion checkpoint on each evaluation split; one result dict per split."""
    from bench.np.data.images import DATASETS
    from bench.np.tasks.np_tasks import image_task
    from bench.np.train import load_checkpoint

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
            from bench.np.tasks.image_plot import plot_completions

            path = _out_dir(run_dir) / f"completions_{name}.png"
            result["figure"] = str(plot_completions(model, sampler, path, plot_images))
        (_out_dir(run_dir) / f"eval_{dataset}_{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        results.append(result)
    return results


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    try:
        if args.task == "gp":
            results = [evaluate(args.ckpt, args.kernel, num_batches=args.num_batches, length_range=args.length_range,
                                block_size=args.block_size, data_dir=args.data_dir)]
        else:
            results = evaluate_images(args.ckpt, dataset=args.dataset, data_dir=args.data_dir, split=args.split,
                                      num_batches=args.num_batches, block_size=args.block_size,
                                      plot_images=args.plot_images)
    except (FileNotFoundError, ValueError, ImportError) as exc:
        print(f"python -m bench eval: error: {exc}", file=sys.stderr)
        return 1
    for r in results:
        what = r["kernel"] if args.task == "gp" else f"{r['dataset']} {r['split']}"
        print(f"{r['model']} {what}: log-likelihood {r['log_likelihood_mean']:.3f} ± {r['log_likelihood_std']:.3f} "
              f"over {r['num_batches']} batches of {r['batch_size']} (after {r['train_steps']} steps)")
    return 0
