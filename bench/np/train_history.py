"""The training curve of a run: ``loss_history.csv`` in the run directory, one row per log point.

A resumed run continues the file from its checkpoint: rows logged after the last checkpoint (by an
invocation that was then killed) are dropped, since those steps are trained again and would otherwise
appear twice.

Each row also holds the gradient's global L2 norm (mean and largest over the window), because a loss
spike shows there first; files written before those columns existed still read, with NaN there.
"""
from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import List, NamedTuple

HISTORY = "loss_history.csv"
_COLUMNS = ("step", "loss", "lr", "steps_per_s", "grad_norm", "grad_norm_max")


class LogPoint(NamedTuple):
    """Means over the steps since the previous log point, ending at ``step``: the training loss and the
    gradient's global L2 norm (before the optimiser step), and the largest of those norms."""

    step: int
    loss: float
    lr: float
    steps_per_s: float
    grad_norm: float = math.nan
    grad_norm_max: float = math.nan


def _number(text) -> float:
    return float(text) if text not in (None, "") else math.nan


def read_history(run_dir: Path) -> List[LogPoint]:
    """The log points of ``run_dir`` in step order; ``[]`` when the run has no history file (runs
    trained before it existed)."""
    path = Path(run_dir) / HISTORY
    if not path.exists():
        return []
    with path.open(newline="") as f:
        rows = [LogPoint(int(r["step"]), float(r["loss"]), float(r["lr"]), float(r["steps_per_s"]),
                         _number(r.get("grad_norm")), _number(r.get("grad_norm_max")))
                for r in csv.DictReader(f)]
    return sorted(rows, key=lambda p: p.step)


def _row(point: LogPoint) -> list:
    def norm(value: float) -> str:
        return "" if math.isnan(value) else f"{value:.6g}"

    return [point.step, f"{point.loss:.6g}", f"{point.lr:.6g}", f"{point.steps_per_s:.4g}",
            norm(point.grad_norm), norm(point.grad_norm_max)]


def start_history(run_dir: Path, resumed_at: int) -> None:
    """Start the file of a fresh run (``resumed_at`` 0) or keep the rows up to the checkpoint's step."""
    kept = [p for p in read_history(run_dir) if p.step <= resumed_at] if resumed_at > 0 else []
    with (Path(run_dir) / HISTORY).open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(_COLUMNS)
        writer.writerows(_row(p) for p in kept)


def append_history(run_dir: Path, point: LogPoint) -> None:
    """Add one log point (flushed at once, so that a killed run keeps its curve)."""
    with (Path(run_dir) / HISTORY).open("a", newline="") as f:
        csv.writer(f).writerow(_row(point))
