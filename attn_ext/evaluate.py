"""``attn-ext eval gp``: mean per-target log-likelihood of a trained model on the fixed-seed GP set.

The metric is SPEC §6's: per task, the mean over targets of the Gaussian log-likelihood summed over
y dimensions; reported as mean ± std over the evaluation batches (each batch's value is the mean
over its tasks). CMANP-AND is scored block-autoregressively (``--block-size``, CMANP App. C.2).
Writes ``eval_<kernel>.json`` into the run directory.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

from attn_ext.data.eval_set import FULL_NUM_BATCHES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("task", choices=["gp"])
    parser.add_argument("--ckpt", type=Path, required=True, help="run directory of `attn-ext train` or a checkpoint file")
    parser.add_argument("--kernel", choices=["rbf", "matern52", "periodic"], default="rbf")
    parser.add_argument("--length-range", choices=["code", "paper"], default="code")
    parser.add_argument("--num-batches", type=int, default=FULL_NUM_BATCHES,
                        help=f"evaluation batches of 16 (default {FULL_NUM_BATCHES}, the full protocol)")
    parser.add_argument("--block-size", type=int, default=None, help="b_Q of CMANP-AND (default: the model's, 5)")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="cache of the evaluation set (default $ATTN_EXT_DATA or ~/.cache/attn_ext)")
    parser.add_argument("--threads", type=int, default=1)


def evaluate(run_dir: Path, kernel: str = "rbf", *, num_batches: int = FULL_NUM_BATCHES,
             length_range: str = "code", block_size: Optional[int] = None, data_dir: Optional[Path] = None) -> dict:
    """Evaluate a checkpoint; returns (and writes next to it) the result dict."""
    import torch

    from attn_ext.data import evaluation_set
    from attn_ext.models import CMANPAND
    from attn_ext.train import load_checkpoint

    model, ckpt = load_checkpoint(run_dir)
    model.eval()
    batches = evaluation_set(kernel, num_batches, length_range=length_range, cache_dir=data_dir)
    kwargs = {"block_size": block_size} if isinstance(model, CMANPAND) else {}
    start = time.perf_counter()
    with torch.no_grad():
        per_batch = torch.stack([model.log_likelihood(b, **kwargs).mean() for b in batches])
    result = {
        "model": ckpt["model"], "kernel": kernel, "length_range": length_range, "num_batches": num_batches,
        "batch_size": batches[0].xc.shape[0], "train_steps": ckpt["step"], "train_seconds": ckpt["elapsed"],
        "log_likelihood_mean": per_batch.mean().item(), "log_likelihood_std": per_batch.std().item(),
        "eval_seconds": round(time.perf_counter() - start, 1),
    }
    if kwargs:
        result["block_size"] = block_size or model.block_size
    out_dir = run_dir if run_dir.is_dir() else run_dir.parent
    (out_dir / f"eval_{kernel}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    try:
        r = evaluate(args.ckpt, args.kernel, num_batches=args.num_batches, length_range=args.length_range,
                     block_size=args.block_size, data_dir=args.data_dir)
    except (FileNotFoundError, ValueError) as exc:
        print(f"attn-ext eval: error: {exc}", file=sys.stderr)
        return 1
    print(f"{r['model']} {r['kernel']}: log-likelihood {r['log_likelihood_mean']:.3f} ± {r['log_likelihood_std']:.3f} "
          f"over {r['num_batches']} batches of {r['batch_size']} (after {r['train_steps']} steps)")
    return 0
