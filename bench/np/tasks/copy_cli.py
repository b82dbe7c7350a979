"""``python -m bench train copy``: the TCA copy task (:mod:`bench.np.tasks.copy`) from the command line."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: CLI model names -> :data:`bench.np.tasks.copy.KINDS` (``retreever`` = tree cross attention + TCA loss).
MODEL_KINDS = {"retreever": "tca", "tca": "tca", "ca": "ca"}


def add_copy_arguments(parser: argparse.ArgumentParser) -> None:
    """The copy task's options (``--model both`` trains TCA then CA)."""
    parser.add_argument("--seq-len", type=int, default=64, help="N = 2^k; the context is the first N/2 tokens")
    parser.add_argument("--steps", type=int, default=2200, help="maximum training steps per model")
    parser.add_argument("--model", choices=sorted(MODEL_KINDS) + ["both"], default="retreever",
                        help="retreever/tca: tree cross attention with the TCA objective; ca: full cross attention; "
                             "both: tca, then ca")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--branching", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--alpha", type=float, default=0.01, help="entropy bonus weight (the paper's 0.01)")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="subtract the batch-mean reward (REINFORCE baseline; default on)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--eval-size", type=int, default=3200, help="test sequences (the paper uses 3200)")
    parser.add_argument("--stop-at", type=float, default=1.0, help="stop early once the eval accuracy reaches this")
    parser.add_argument("--out", type=Path, default=None, help="write copy_<model>.json with the result here")


def run_copy(args: argparse.Namespace) -> int:
    """Train the chosen model(s), print the summary; exit status 1 on bad settings."""
    import torch

    from bench.np.tasks.copy import CopyConfig, summary_line, train

    torch.set_num_threads(args.threads)
    kinds = ["tca", "ca"] if args.model == "both" else [MODEL_KINDS[args.model]]
    try:
        configs = [CopyConfig(seq_len=args.seq_len, kind=k, steps=args.steps, batch=args.batch, dim=args.dim,
                              heads=args.heads, branching=args.branching, lr=args.lr, seed=args.seed,
                              alpha=args.alpha, baseline=args.baseline, log_every=args.log_every,
                              eval_size=args.eval_size, stop_at=args.stop_at) for k in kinds]
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
