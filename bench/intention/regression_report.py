"""Report pieces shared by the few-shot regression tasks (sine_few_shot, image_regression): tables, closing
sections and the MSE-vs-observations panel."""
from __future__ import annotations

from bench.harness.machine import machine_markdown
from bench.harness.report import markdown_table


def mse_table(result: dict, names: dict, digits: int) -> str:
    """MSE ± standard error per model, untrained and trained, per number of observations N."""
    cfg, rows = result["config"], result["rows"]
    contexts = [str(n) for n in cfg["eval_context"]]

    def cell(stat):
        return f"{stat['mse']:.{digits}f} ± {stat['sem']:.{digits}f}"

    return markdown_table(
        ["model", "state"] + [f"N = {n}" for n in contexts],
        [[names[m], state] + [cell(rows[m][state][n]) for n in contexts]
         for m in cfg["models"] for state in ("untrained", "trained")])


def budget_table(result: dict, names: dict, digits: int) -> str:
    """Parameters, Adam rate, training seconds and first / last logged train MSE per model."""
    cfg, rows = result["config"], result["rows"]
    return markdown_table(
        ["model", "parameters", "Adam lr", "train s", "first / last logged train MSE"],
        [[names[m], f"{rows[m]['parameters']:,}", f"{rows[m]['lr']:g}", f"{rows[m]['train_seconds']:.0f}",
          f"{rows[m]['train_curve'][0]:.{digits}f} / {rows[m]['train_curve'][-1]:.{digits}f}"]
         for m in cfg["models"]])


def lowest_trained_line(result: dict, names: dict) -> str:
    """``Lowest trained MSE: N = n: model, …``: the best trained model per number of observations."""
    cfg, rows = result["config"], result["rows"]
    contexts = [str(n) for n in cfg["eval_context"]]
    best = {n: min(cfg["models"], key=lambda m: rows[m]["trained"][n]["mse"]) for n in contexts}
    return "Lowest trained MSE: " + ", ".join(f"N = {n}: {names[best[n]]}" for n in contexts) + "."


def closing_sections(result: dict, names: dict, digits: int, differences: str) -> list:
    """The report's last lines: the training table, ``differences`` (from the paper's setup), wall time,
    command and machine, with blank lines between them."""
    cfg = result["config"]
    return ["Training:", "", budget_table(result, names, digits), "", differences, "",
            f"Total wall time {result['wall_seconds']:.0f} s on {cfg['threads']} thread(s).", "",
            f"Command: `{cfg['command']}`", "", machine_markdown(result["machine"])]


def plot_mse_curves(ax, result: dict, names: dict) -> None:
    """The Fig. 7 panel on ``ax``: MSE vs N per model, dashed untrained, solid trained, log-log with only
    the evaluated N labelled (the caller adds labels, title and legend)."""
    import matplotlib.ticker  # matplotlib is optional (figures only): imported when plotting

    cfg, rows = result["config"], result["rows"]
    contexts = [str(n) for n in cfg["eval_context"]]
    ns = [int(n) for n in contexts]
    for i, m in enumerate(cfg["models"]):
        for state, style in (("untrained", "--"), ("trained", "-")):
            ax.plot(ns, [rows[m][state][n]["mse"] for n in contexts], style, marker="o", color=f"C{i}",
                    label=f"{names[m]} ({state})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(ns)
    ax.set_xticklabels(contexts)
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
