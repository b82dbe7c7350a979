"""Report tables shared by the few-shot regression tasks (sine_few_shot, image_regression)."""
from __future__ import annotations


def mse_table(result: dict, names: dict, digits: int) -> str:
    """MSE ± standard error per model, untrained and trained, per number of observations N."""
    from bench.harness.report import markdown_table

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
    from bench.harness.report import markdown_table

    cfg, rows = result["config"], result["rows"]
    return markdown_table(
        ["model", "parameters", "Adam lr", "train s", "first / last logged train MSE"],
        [[names[m], f"{rows[m]['parameters']:,}", f"{rows[m]['lr']:g}", f"{rows[m]['train_seconds']:.0f}",
          f"{rows[m]['train_curve'][0]:.{digits}f} / {rows[m]['train_curve'][-1]:.{digits}f}"]
         for m in cfg["models"]])
