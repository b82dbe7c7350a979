"""``python -m bench``: the command line of the harness, run from the root of a clone.

Subcommands live in :data:`SUBCOMMANDS` (name -> :class:`Subcommand`); adding one means writing its
``add_arguments`` and ``run`` and registering it there. This module imports only the light ``bench`` and
``bench.harness`` modules (no torch); a subcommand's module is imported by name on first use (:func:`_lazy`),
and a benchmark only when it runs (:func:`bench.run_benchmark`).

Examples
--------
``python -m bench run --quick``
    What ``make bench`` runs: every op benchmark on its quick grid and the NP demo, 5-15 minutes on 2 cores;
    tables on stdout, ``<name>.md/.json/.png`` in ``bench/out/`` (git-ignored).
``python -m bench run --update-results``
    What ``make bench-update`` runs: the full grids, written to the committed ``bench/results/`` and
    the README's summary blocks.
``python -m bench run cross_attention --out /tmp/r``
    One benchmark on its full grid, somewhere else.
``python -m bench train gp --model cmanp --steps 100000 --out runs/gp-cmanp``
    Train CMANP on GP regression (resumes from ``runs/gp-cmanp/checkpoint.pt`` if present).
``python -m bench eval gp --ckpt runs/gp-cmanp --kernel rbf``
    Mean per-target log-likelihood ± std over the evaluation batches.
``python -m bench train images --dataset emnist --data-dir ~/data/emnist --model cmanp --out runs/emnist-cmanp``
    Image completion (EMNIST, CelebA 32/64/128, or the offline sklearn ``digits``); ``eval images`` scores it.
``python -m bench train copy --seq-len 256 --model retreever``
    The TCA copy task: accuracy and the fraction of context tokens each query read.
``python -m bench train wheel --model cmanp --out runs/wheel-cmanp`` then ``python -m bench bandit --ckpt runs/wheel-cmanp``
    Wheel bandit: cumulative regret (% of uniform) per δ and the cost of each step.
``python -m bench train gp --chapter-2d --model hypermix_np --out runs/gp2d-hypermix``
    2-D GP regression at the efficient-NP-transformers chapter's sizes (N_c 64, N_t 128); ``eval gp`` scores it.
``python -m bench train sawtooth --model tetnp --out runs/sawtooth-tetnp``
    The Sawtooth process (2-D by default); ``python -m bench eval sawtooth --ckpt RUN`` scores it.
``python -m bench memory --quick``
    Peak inference memory of every model vs N_c and N_t.
``python -m bench run chapter_memory``
    Peak inference memory of every model on the chapter's 2-D grid, beside the chapter's figures.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import bench
from bench import BENCHMARKS, DEFAULT_BENCHMARKS
from bench.harness import OUT_DIR, RESULTS_DIR, BenchOptions, goals
from bench.harness.report import progress

PROG = "python -m bench"


@dataclass(frozen=True)
class Subcommand:
    """One ``python -m bench`` subcommand.

    Attributes
    ----------
    help : str
        One-line description shown by ``python -m bench --help``.
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


def _run_arguments(parser: argparse.ArgumentParser) -> None:
    # Validated in _run: argparse rejects an empty nargs="*" list against choices on 3.11.
    parser.add_argument("benchmarks", nargs="*", metavar="NAME",
                        help=f"benchmarks to run (default: {', '.join(DEFAULT_BENCHMARKS)}; also: "
                             f"{', '.join(n for n in BENCHMARKS if n not in DEFAULT_BENCHMARKS)})")
    parser.add_argument("--quick", action="store_true",
                        help="the quick grid (make bench): smaller sizes, each benchmark in seconds to about two "
                             "minutes on a 2-core machine; goals defined on the full grid are marked as such")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help=f"output directory for <name>.md/.json/.png (default: {OUT_DIR}, git-ignored)")
    parser.add_argument("--update-results", action="store_true",
                        help=f"write to the committed {RESULTS_DIR}/ and rewrite the README's summary blocks "
                             "(make bench-update); full grid only")
    parser.add_argument("--backend", default="cpp",
                        help="attn_ext backend to measure, as backend= of the op (default: cpp)")
    parser.add_argument("--repeats", type=_positive_int, default=None,
                        help="timed repeats per measurement after the warm-up (at least 0.5 s); the median is reported "
                             "(default: 5, with --quick 3)")
    parser.add_argument("--update-readme", type=Path, metavar="PATH",
                        help="rewrite the block between <!-- bench:NAME:start --> and <!-- bench:NAME:end --> in PATH")


def _run(args: argparse.Namespace) -> int:
    unknown = [n for n in args.benchmarks if n not in BENCHMARKS]
    if unknown:
        print(f"{PROG} run: error: unknown benchmark(s) {', '.join(unknown)}; "
              f"choose from {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    if args.update_results and (args.quick or args.out is not None):
        # The committed results are the full grid's, where the goals are defined.
        print(f"{PROG} run: error: --update-results writes the full grid to {RESULTS_DIR}/; "
              "it takes neither --quick nor --out", file=sys.stderr)
        return 2
    readme = args.update_readme or (Path("README.md") if args.update_results else None)
    options = BenchOptions(quick=args.quick, out_dir=RESULTS_DIR if args.update_results else (args.out or OUT_DIR),
                           backend=args.backend, repeats=args.repeats or (3 if args.quick else 5), update_readme=readme,
                           command=" ".join([PROG, *map(shlex.quote, args.argv)]))
    # A quick run re-measures a doubtful goal after a shorter wait for the machine to settle.
    goals.QUIET_WAIT_S = 3.0 if args.quick else goals.QUIET_WAIT_S
    names = args.benchmarks or list(DEFAULT_BENCHMARKS)
    status, start, times = 0, time.perf_counter(), []
    # Keep going after a failing benchmark so one broken op does not hide the others' results.
    for i, name in enumerate(names, 1):
        progress(f"=== [{i}/{len(names)}] {name} ({options.grid} grid)")
        t0 = time.perf_counter()
        status = max(status, bench.run_benchmark(name, options))
        times.append(f"{name} {time.perf_counter() - t0:.0f} s")
    progress(f"=== done in {time.perf_counter() - start:.0f} s ({', '.join(times)}); "
             f"results in {options.out_dir}/" + ("" if status == 0 else f"; exit status {status}"))
    return status


def _lazy(module: str, attr: str) -> Callable:
    """``module.attr`` imported on first call, so that ``--help`` imports neither torch nor the models."""
    def call(*args):
        return getattr(importlib.import_module(module), attr)(*args)

    return call


#: Subcommand name -> definition; ``main`` builds the parser from this table.
SUBCOMMANDS: dict[str, Subcommand] = {
    "run": Subcommand(
        help="benchmark attn_ext ops against PyTorch (time, GFLOP/s, peak memory) and run the NP demo",
        add_arguments=_run_arguments,
        run=_run,
    ),
    "train": Subcommand(
        help="train a reference NP model on GP regression, image completion or wheel-bandit problems (resumable), or the TCA copy task",
        add_arguments=_lazy("bench.np.train", "add_arguments"),
        run=_lazy("bench.np.train", "run"),
    ),
    "eval": Subcommand(
        help="evaluate a trained NP model on the fixed-seed GP set or its image dataset's evaluation splits",
        add_arguments=_lazy("bench.np.evaluate", "add_arguments"),
        run=_lazy("bench.np.evaluate", "run"),
    ),
    "bandit": Subcommand(
        help="deploy wheel-bandit models (train wheel) for T steps with UCB: regret vs uniform, cost per step",
        add_arguments=_lazy("bench.np.tasks.bandit_cli", "add_arguments"),
        run=_lazy("bench.np.tasks.bandit_cli", "run"),
    ),
    "intention": Subcommand(
        help="the Intention paper's experiments (least squares, regression, few-shot, remapping, ...) at a small budget",
        add_arguments=_lazy("bench.intention", "add_arguments"),
        run=_lazy("bench.intention", "run"),
    ),
    "memory": Subcommand(
        help="peak inference memory of the NP models vs context and target size (table + log-log PNG)",
        add_arguments=_lazy("bench.np.np_memory", "add_arguments"),
        run=_lazy("bench.np.np_memory", "run_cli"),
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m bench`` parser with one sub-parser per entry of :data:`SUBCOMMANDS`."""
    parser = argparse.ArgumentParser(prog=PROG, description="attn_ext's benchmarks and paper-reproduction harness "
                                                            "(run from the root of a clone).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cmd in SUBCOMMANDS.items():
        cmd.add_arguments(sub.add_parser(name, help=cmd.help, description=cmd.help))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m bench``.

    Parameters
    ----------
    argv : sequence of str, optional
        Arguments without the program name; ``sys.argv[1:]`` when None.

    Returns
    -------
    int
        Exit status of the subcommand (argparse exits with 2 on bad usage).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return SUBCOMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
