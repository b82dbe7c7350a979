"""Report pieces shared by the Intention tasks: the closing lines, publishing (with the run of the sweep
tasks around it), the comparison with Intention, and the smoothing and saving of their figures."""
from __future__ import annotations

import datetime
import sys
import time

import torch

from bench.harness.machine import load_average, machine_info, machine_markdown
from bench.harness.report import progress, publish
from bench.intention import command_line


def report_sections(*sections: str, result: dict) -> str:
    """The report's paragraphs and tables separated by blank lines, closed by the wall time and the machine."""
    return "\n\n".join([*sections, f"Wall time {result['wall_seconds']:.0f} s. " + machine_markdown(result["machine"])])


def produced_by(result: dict, threads: int | None = None) -> str:
    """The sentence that ends a report: the command of ``result``; with ``threads``, also the threads and the date."""
    if threads is None:
        return f"\n\nProduced by `{result['command']}`."
    return (f"\n\nProduced by `{result['command']}` (1 thread: `--threads {threads}`), "
            f"{datetime.date.today().isoformat()}.")


def publish_report(name: str, result: dict, args, tables, plot, *, dated: bool = True) -> int:
    """Print and write ``<name>.md`` (``tables(result)`` and :func:`produced_by`, with the threads and date
    when ``dated``), ``<name>.json`` and the PNG of ``plot`` to ``args.out``; returns the exit status 0."""
    publish(name, tables(result) + produced_by(result, args.threads if dated else None), result, args.out, plot)
    return 0


def finish_run(machine: dict, task: str, args) -> str:
    """Record the load average at the end of the run in ``machine``; returns the command that names the run."""
    machine["load_average_end"] = load_average()
    return command_line(task, args).strip()


def publish_runs(name: str, task: str, args, *, machine: dict, runs: dict, start: float, config: dict, tables, plot,
                 **fields) -> int:
    """Publish a task that trains models into ``runs`` (point_cloud, policy_distillation, anomaly_detection,
    few_shot_classification): the result ``{"benchmark", "machine", "command", "runs", **fields,
    "wall_seconds", "config"}`` (see :func:`finish_run`; wall time from ``start``), its report dated.
    Returns the exit status 0."""
    command = finish_run(machine, task, args)
    result = {"benchmark": name, "machine": machine, "command": command, "runs": runs, **fields,
              "wall_seconds": time.perf_counter() - start, "config": config}
    return publish_report(name, result, args, tables, plot)


def publish_rows(name: str, task: str, args, *, machine: dict, rows: list, start: float, config: dict, tables, plot,
                 **fields) -> int:
    """Publish a task whose result is a list of measured ``rows`` (least_squares, kernelised_size, slowdown):
    the result ``{"benchmark", "command", "machine", "rows", **fields, "wall_seconds", "config"}`` (see
    :func:`finish_run`; wall time from ``start``, to 0.1 s), its report ending with the command, undated.
    Returns the exit status 0."""
    command = finish_run(machine, task, args)
    result = {"benchmark": name, "command": command, "machine": machine, "rows": rows, **fields,
              "wall_seconds": round(time.perf_counter() - start, 1), "config": config}
    return publish_report(name, result, args, tables, plot, dated=False)


def run_sweep(name: str, task: str, args, *, validate, sweep, config: dict, tables, plot) -> int:
    """The run of a task that trains a sweep of models into rows (least_squares, kernelised_size).

    ``validate(args)`` raising ``ValueError`` ends it with :func:`option_error` (status 2); otherwise
    ``sweep(progress)`` returns the rows, on ``args.threads`` torch threads, and :func:`publish_rows`
    publishes them with ``config``.
    """
    try:
        validate(args)
    except ValueError as exc:
        return option_error(exc)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    rows = sweep(progress)
    return publish_rows(name, task, args, machine=machine_info(), rows=rows, start=start, config=config,
                        tables=tables, plot=plot)


def option_error(exc: ValueError) -> int:
    """Print a rejected option as the command line's ``error:`` line; returns the exit status 2."""
    print(f"error: {exc}", file=sys.stderr)
    return 2


def intention_margin(errors: dict, labels: dict, metric: str) -> str:
    """How far Intention is ahead of (or behind) the best other model, as a ratio of ``errors`` (model ->
    its ``metric``, lower is better).

    Examples
    --------
    >>> intention_margin({"intention": 0.1, "mlp": 0.3}, {"intention": "Intention", "mlp": "MLP"}, "MSE")
    "the next best (MLP) has 3.0× Intention's MSE"
    """
    order = sorted(errors, key=errors.get)
    if "intention" not in errors or len(order) < 2:
        return "n/a"
    mine = errors["intention"]
    if order[0] == "intention":
        nxt = order[1]
        return f"the next best ({labels[nxt]}) has {errors[nxt] / mine:.1f}× Intention's {metric}"
    return f"Intention's {metric} is {mine / errors[order[0]]:.1f}× the best's ({labels[order[0]]})"


def moving_average(values, window: int) -> list:
    """Mean of each value and up to ``window - 1`` before it (fewer at the start): a loss curve's smoothing."""
    return [sum(values[max(0, j - window + 1):j + 1]) / len(values[max(0, j - window + 1):j + 1])
            for j in range(len(values))]


def save_figure(fig, path, dpi: int, legends=()) -> None:
    """Give each axes of ``legends`` a small legend and a medium title, lay ``fig`` out, write it, close it."""
    import matplotlib.pyplot as plt  # optional, figures only (the figure came from pyplot() below, on Agg)

    for ax in legends:
        ax.legend(fontsize="small")
        ax.title.set_fontsize("medium")
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (the figures are written to files, never shown)."""
    # matplotlib is optional (figures only): imported when plotting, on the Agg backend (files, no display).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
