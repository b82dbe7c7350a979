"""Benchmark figures, log-log: time and peak memory vs size (two panels), or one panel."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


@dataclass(frozen=True)
class Series:
    """One line of a panel.

    Attributes
    ----------
    label : str
    xs, ys : sequence of float
        Points with ``y`` None or <= 0 are dropped (not measurable, or not
        drawable on a log axis).
    linestyle, marker, color : str
        Matplotlib styles, so that related lines (same implementation, same
        pass) look related; ``color`` None takes the next in the cycle.
    """

    label: str
    xs: Sequence[float]
    ys: Sequence[float | None]
    linestyle: str = "-"
    marker: str = "o"
    color: str | None = None


def _draw(ax, series: Sequence[Series]) -> None:
    drawn = False
    for s in series:
        pts = [(x, y) for x, y in zip(s.xs, s.ys) if y is not None and y > 0]
        if not pts:
            continue
        xs, ys = zip(*pts)
        ax.plot(xs, ys, linestyle=s.linestyle, marker=s.marker, color=s.color, label=s.label)
        drawn = True
    ax.set_xscale("log")
    if drawn:
        ax.set_yscale("log")
        lo, hi = ax.get_ylim()
        # Span at least two decades: a log axis zoomed onto a flat line makes noise look like a trend.
        if hi / lo < 100:
            mid = (lo * hi) ** 0.5
            ax.set_ylim(mid / 10, mid * 10)
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.grid(True, which="both", alpha=0.3)


def plot_time_and_memory(
    time_series: Sequence[Series],
    memory_series: Sequence[Series],
    path: str | Path,
    title: str,
    xlabel: str,
    time_label: str = "time (ms, median)",
    memory_label: str = "peak extra memory (MB)",
    titles: tuple[str, str] = ("time", "memory"),
) -> None:
    """Write a two-panel PNG (left: time, right: memory, or two other quantities named by ``titles``) to ``path``.

    Uses the non-interactive Agg backend so it works without a display.
    """
    # matplotlib is optional (figures only): imported when plotting, on the Agg backend (files, no display).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    _draw(ax_t, time_series)
    ax_t.set_xlabel(xlabel)
    ax_t.set_ylabel(time_label)
    ax_t.set_title(titles[0])
    _draw(ax_m, memory_series)
    ax_m.set_xlabel(xlabel)
    ax_m.set_ylabel(memory_label)
    ax_m.set_title(titles[1])
    fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_panel(series: Sequence[Series], path: str | Path, title: str, xlabel: str, ylabel: str) -> None:
    """Write a one-panel log-log PNG to ``path`` (Agg backend, no display needed)."""
    # matplotlib is optional (figures only): imported when plotting, on the Agg backend (files, no display).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    _draw(ax, series)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_pass_bars(rows: dict, names: Sequence[str], path: str | Path, title: str) -> None:
    """Bars of the median time of each of ``names`` per pass: ``rows[pass][name]["median_ms"]`` (None: 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    passes = list(rows)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar([x + i * width for x in range(len(passes))], [rows[p][name]["median_ms"] or 0 for p in passes], width,
               label=name)
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(passes))], passes)
    ax.set_ylabel("ms (median)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
