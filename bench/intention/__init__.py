"""The Intention paper's experiments as tasks of the harness: ``python -m bench intention TASK``.

Each task is one module of this folder exposing ``add_arguments(parser)`` and ``run(args) -> int``
(an exit status); it trains or measures at a small, recorded budget, prints a table and writes
``<task>.md/.json`` (and a PNG where a figure says more) to ``--out`` (default ``bench/out``,
git-ignored; the committed results are in ``bench/results/intention_<task>.md``).
:data:`TASKS` maps the task names to their modules; modules are imported only when run.
"""
from __future__ import annotations

import argparse
import importlib

#: Task name -> module implementing ``add_arguments(parser)`` and ``run(args) -> int``.
TASKS: dict[str, str] = {
    "least_squares": "bench.intention.least_squares", "slowdown": "bench.intention.slowdown",
    "map_variance": "bench.intention.map_variance", "kernelised_size": "bench.intention.kernelised_size",
    "point_cloud": "bench.intention.point_cloud",
    "policy_distillation": "bench.intention.policy_distillation",
    "few_shot_classification": "bench.intention.few_shot_classification",
    "anomaly_detection": "bench.intention.anomaly_detection",
    "regression_2d": "bench.intention.regression_2d", "sine_few_shot": "bench.intention.sine_few_shot",
    "image_regression": "bench.intention.image_regression",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One sub-parser per task; a task's options are its module's."""
    sub = parser.add_subparsers(dest="task", metavar="TASK", required=True)
    for name, module in TASKS.items():
        task = importlib.import_module(module)
        task.add_arguments(sub.add_parser(name, help=(task.__doc__ or name).strip().splitlines()[0]))


def command_line(task: str, args: argparse.Namespace) -> str:
    """The command a task's report names: ``python -m bench intention TASK OPTIONS``, the options from
    ``args.argv`` (what ``python -m bench`` parsed; none when a task is called without it)."""
    return " ".join(["python -m bench intention", task, *getattr(args, "argv", [])[2:]])


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(TASKS[args.task]).run(args)
