"""``python -m bench train copy``: the TCA copy task (:mod:`bench.np.tasks.copy`) from the command line."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from bench.np.tasks.copy import CopyConfig, summary_line, train
from bench.np.tasks.copy_models import TREE_DESIGNS

#: CLI model names -> :data:`bench.np.tasks.copy.KINDS` (``retreever`` = tree cross attention + TCA loss).
MODEL_KINDS = {"retreever": "tca", "tca": "tca", "ca": "ca", "perceiver": "perceiver"}
#: Options that only the tree cross attention model takes (``--model both`` gives them to tca only).
TCA_OPTIONS = ("tree_design", "reward", "lambda_rl", "lambda_ca")


def add_copy_arguments(parser: argparse.ArgumentParser) -> None:
    """The copy task's options (``--model both`` trains TCA then CA)."""
    parser.add_argument("--seq-len", type=int, default=64, help="N = 2^k; the context is the first N/2 tokens")
    parser.add_argument("--steps", type=int, default=2200, help="maximum training steps per model")
    parser.add_argument("--model", choices=sorted(MODEL_KINDS) + ["both"], default="retreever",
                        help="retreever/tca: tree cross attention with the TCA objective; ca: full cross attention; "
                             "perceiver: Perceiver IO with as many latents as TCA reads tokens; both: tca, then ca")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--branching", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--alpha", type=float, default=0.01, help="entropy bonus weight (the paper's 0.01)")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="subtract the batch-mean reward (REINFORCE baseline; default on)")
    parser.add_argument("--tree-design", choices=TREE_DESIGNS, default="position",
                        help="tca: leaf order (TCA Table 6): position (sequence order, default), random (fresh per "
                             "sequence), kd-x0 / kd-x1 (positions folded into a 2-D grid, sorted on its row / column "
                             "only), kd-rp (sorted on a fixed random projection of the grid coordinates)")
    parser.add_argument("--reward", choices=("accuracy", "neg-ce"), default="accuracy",
                        help="tca: REINFORCE reward (TCA Table 5): 0/1 accuracy (default) or negative cross entropy")
    parser.add_argument("--lambda-rl", type=float, default=1.0, help="tca: weight of the RL term (paper: 1)")
    parser.add_argument("--lambda-ca", type=float, default=1.0,
                        help="tca: weight of the full-cross-attention term (paper: 1)")
    parser.add_argument("--latents", type=int, default=None,
                        help="perceiver: latents = tokens each query reads (default: TCA's tree_num_selected(N/2, b))")
    parser.add_argument("--perceiver-layers", type=int, default=1,
                        help="perceiver: iterative attention blocks (cross attention + latent self attention)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--eval-size", type=int, default=3200, help="test sequences (the paper uses 3200)")
    parser.add_argument("--stop-at", type=float, default=1.0, help="stop early once the eval accuracy reaches this")
    parser.add_argument("--out", type=Path, default=None, help="write copy_<model>.json with the result here")


def copy_configs(args: argparse.Namespace) -> list:
    """The :class:`~bench.np.tasks.copy.CopyConfig` of each model ``args`` asks for (``ValueError`` if bad)."""
    kinds = ["tca", "ca"] if args.model == "both" else [MODEL_KINDS[args.model]]
    common = dict(seq_len=args.seq_len, steps=args.steps, batch=args.batch, dim=args.dim, heads=args.heads,
                  branching=args.branching, lr=args.lr, seed=args.seed, alpha=args.alpha, baseline=args.baseline,
                  log_every=args.log_every, eval_size=args.eval_size, stop_at=args.stop_at)
    tca = {k: getattr(args, k) for k in TCA_OPTIONS}
    perceiver = dict(latents=args.latents, perceiver_layers=args.perceiver_layers)
    configs = []
    for k in kinds:
        # ``both`` gives the tca options to tca alone; any other misplaced option raises in CopyConfig.
        extra = tca if (k == "tca" or args.model != "both") else {}
        configs.append(CopyConfig(kind=k, **common, **extra, **perceiver))
    return configs


def run_copy(args: argparse.Namespace) -> int:
    """Train the chosen model(s), print the summary; exit status 1 on bad settings."""
    torch.set_num_threads(args.threads)
    try:
        configs = copy_configs(args)
    except ValueError as exc:
        print(f"python -m bench train copy: error: {exc}", file=sys.stderr)
        return 1
    results = [train(c) for c in configs]
    print(f"\ncopy task, seq len {args.seq_len} (context {args.seq_len // 2} tokens, "
          f"{args.seq_len // 2} queries per sequence), {args.eval_size} test sequences")
    for r in results:
        print("  " + summary_line(r))
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"copy_{r['kind']}.json").write_text(json.dumps(r, indent=2) + "\n")
    return 0
