"""Training curves of the GP runs (``loss_history.csv`` of each run directory) as one PNG panel."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

from bench.np.train_history import read_history

#: Log points averaged for the drawn line: one log point is the mean of a few hundred steps, and GP
#: tasks differ so much from batch to batch that single points hide the trend.
SMOOTHING = 8


def collect_curves(runs_dir: Path, labels: Dict[str, str], targets: Dict[str, Optional[float]]) -> dict:
    """``{run name: {"label", "steps", "loss", "target"}}`` for every run directory of ``runs_dir``
    with a training history; ``labels``/``targets`` (the paper's RBF log-likelihood, drawn as its
    negative) by run name, where known."""
    curves = {}
    for run in sorted(p for p in Path(runs_dir).iterdir() if p.is_dir()):
        points = read_history(run)
        if points:
            curves[run.name] = {"label": labels.get(run.name, run.name), "steps": [p.step for p in points],
                                "loss": [p.loss for p in points], "target": targets.get(run.name)}
    return curves


def _smooth(values, width: int):
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= width:
            total -= values[i - width]
        out.append(total / min(i + 1, width))
    return out


def plot_training_curves(curves: dict, path: Path, title: str) -> None:
    """Training loss against step, one line per run, with the paper's −log-likelihood dotted in the
    same colour where the run has a ``target`` (the training loss is then the per-target NLL on RBF
    tasks, which the evaluation's log-likelihood negates)."""
    # matplotlib is optional (figures only): imported when plotting, on the Agg backend (files, no display).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, c in curves.items():
        (line,) = ax.plot([s / 1000 for s in c["steps"]], _smooth(c["loss"], SMOOTHING), label=c["label"], lw=1.2)
        if c.get("target") is not None:
            ax.axhline(-c["target"], color=line.get_color(), ls=":", lw=1)
    ax.set_xlabel("training step (thousands)")
    ax.set_ylabel(f"training loss (mean of {SMOOTHING} log points)")
    ax.set_title(title, fontsize="medium")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
