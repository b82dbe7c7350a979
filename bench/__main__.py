"""``attn-ext`` command line.

Subcommands live in :data:`SUBCOMMANDS` (name -> :class:`Subcommand`); adding
one means writing its ``add_arguments`` and ``run`` and registering it there.
Heavy imports (torch, the benchmarks) happen inside ``run`` so that ``--help``
is instant.

Examples
--------
``attn-ext bench --quick``
    Cross-attention benchmark at N = 1e3, 1e4, 1e5 into ``bench/results/``.
``attn-ext bench --out /tmp/r --update-readme README.md``
    Full run (adds N = 3e5) and rewrite the README's results block.
``attn-ext train gp --model cmanp --steps 100000 --out runs/gp-cmanp``
    Train CMANP on GP regression (resumes from ``runs/gp-cmanp/checkpoint.pt`` if present).
``attn-ext eval gp --ckpt runs/gp-cmanp --kernel rbf``
    Mean per-target log-likelihood ± std over the evaluation batches.
``attn-ext train images --dataset emnist --data-dir ~/data/emnist --model cmanp --out runs/emnist-cmanp``
    Image completion (EMNIST, CelebA 32/64/128, or the offline sklearn ``digits``); ``eval images`` scores it.
``attn-ext train copy --seq-len 256 --model retreever``
    The TCA copy task: accuracy and the fraction of context tokens each query read.
``attn-ext train wheel --model cmanp --out runs/wheel-cmanp`` then ``attn-ext bandit --ckpt runs/wheel-cmanp``
    Wheel bandit: cumulative regret (% of uniform) per δ and the cost of each step.
``attn-ext memory --quick``
    Peak inference memory of every model vs N_c and N_t.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence


@dataclass(frozen=True)
class Subcommand:
    """One ``attn-ext`` subcommand.

    Attributes
    ----------
    help : str
        One-line description shown by ``attn-ext --help``.
    add_arguments : callable
        Adds the subcommand's options to its ``argparse`` sub-parser.
    run : callable
        Takes the parsed namespace and returns the process exit status.
    """

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    from .bench import BENCHMARKS  # light: no torch import

    # Validated in _bench_run: argparse rejects an empty nargs="*" list against choices on 3.11.
    parser.add_argument("benchmarks", nargs="*", metavar="NAME",
                        help=f"benchmarks to run (default: all): {', '.join(BENCHMARKS)}")
    parser.add_argument("--quick", action="store_true",
                        help="the quick sizes (cross attention N = 1e3..1e5, state update N = 1e3..1e6, "
                             "streaming N = 1e4..1e6, NP memory N_c = 1e3, 1e4, a 100-step NP training smoke "
                             "run), a few minutes on 2 cores")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), metavar="DIR",
                        help="output directory for <name>.md/.json/.png (default: bench/results, relative to cwd)")
    parser.add_argument("--backend", default="cpp",
                        help="attn_ext backend to measure, as backend= of the op (default: cpp)")
    parser.add_argument("--repeats", type=_positive_int, default=5,
                        help="timed repeats per measurement after the warm-up (at least 0.5 s); the median is reported (default: 5)")
    parser.add_argument("--update-readme", type=Path, metavar="PATH",
                        help="rewrite the block between <!-- bench:NAME:start --> and <!-- bench:NAME:end --> in PATH")


def _bench_run(args: argparse.Namespace) -> int:
    from .bench import BENCHMARKS, BenchOptions, run_benchmark

    unknown = [n for n in args.benchmarks if n not in BENCHMARKS]
    if unknown:
        print(f"attn-ext bench: error: unknown benchmark(s) {', '.join(unknown)}; "
              f"choose from {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    options = BenchOptions(quick=args.quick, out_dir=args.out, backend=args.backend,
                           repeats=args.repeats, update_readme=args.update_readme)
    status = 0
    # Keep going after a failing benchmark so one broken op does not hide the others' results.
    for name in args.benchmarks or list(BENCHMARKS):
        status = max(status, run_benchmark(name, options))
    return status


def _lazy(module: str, attr: str) -> Callable:
    """``module.attr`` imported on first call, so that ``--help`` imports neither torch nor the models."""
    def call(*args):
        import importlib

        return getattr(importlib.import_module(module), attr)(*args)

    return call


#: Subcommand name -> definition; ``main`` builds the parser from this table.
SUBCOMMANDS: dict[str, Subcommand] = {
    "bench": Subcommand(
        help="benchmark attn_ext ops against PyTorch (time, GFLOP/s, peak memory)",
        add_arguments=_bench_arguments,
        run=_bench_run,
    ),
    "train": Subcommand(
        help="train a reference NP model on GP regression, image completion or wheel-bandit problems (resumable), or the TCA copy task",
        add_arguments=_lazy("attn_ext.train", "add_arguments"),
        run=_lazy("attn_ext.train", "run"),
    ),
    "eval": Subcommand(
        help="evaluate a trained NP model on the fixed-seed GP set or its image dataset's evaluation splits",
        add_arguments=_lazy("attn_ext.evaluate", "add_arguments"),
        run=_lazy("attn_ext.evaluate", "run"),
    ),
    "bandit": Subcommand(
        help="deploy wheel-bandit models (train wheel) for T steps with UCB: regret vs uniform, cost per step",
        add_arguments=_lazy("attn_ext.tasks.bandit_cli", "add_arguments"),
        run=_lazy("attn_ext.tasks.bandit_cli", "run"),
    ),
    "memory": Subcommand(
        help="peak inference memory of the NP models vs context and target size (table + log-log PNG)",
        add_arguments=_lazy("attn_ext.bench.np_memory", "add_arguments"),
        run=_lazy("attn_ext.bench.np_memory", "run_cli"),
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The ``attn-ext`` parser with one sub-parser per entry of :data:`SUBCOMMANDS`."""
    parser = argparse.ArgumentParser(prog="attn-ext", description="attn_ext command line tools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cmd in SUBCOMMANDS.items():
        cmd.add_arguments(sub.add_parser(name, help=cmd.help, description=cmd.help))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``attn-ext`` console script.

    Parameters
    ----------
    argv : sequence of str, optional
        Arguments without the program name; ``sys.argv[1:]`` when None.

    Returns
    -------
    int
        Exit status of the subcommand (argparse exits with 2 on bad usage).
    """
    args = build_parser().parse_args(argv)
    return SUBCOMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
