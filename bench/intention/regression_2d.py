"""Fig. 4: Attention, Linear Attention, Intention and σIntention applied to 2-D linear regression (Pearson r).

The Intention paper (Garnelo & Czarnecki, §2 and appendix §3) draws one linear-regression task in
2-D, ``w ~ N(0, 10 I)``, keys ``K ~ N(0, Σ_K)`` from a skewed Gaussian and values ``V = K w``, and
applies the four computations *as they are, untrained* to queries over a square of the input
space: ``[-1, 1]²`` (interpolation: the keys mostly lie there) and ``[-25, 25]²``
(extrapolation)::

    Attention          softmax(Q Kᵀ) V
    Linear Attention   Q Kᵀ V
    Intention          Q (KᵀK)⁻¹ Kᵀ V
    σIntention         softmax(Q (KᵀK)⁻¹ Kᵀ) V

Its Fig. 4 shows the predictions over the square and a scatter of prediction against truth, titled
with their Pearson correlation. This task draws the same picture for one task and reports the
correlations of that task and their mean over ``--tasks`` further draws.

The paper prints ``Σ_K = [[0.7, 0.9], [0.9, 1.0]]``, which is not a covariance (its determinant is
-0.11). NumPy's sampler, given that matrix, factors it by an SVD and so samples from its matrix
absolute value ``|Σ| = U |Λ| Uᵀ`` (same eigenvectors, eigenvalues 1.76 and 0.06, correlation 0.93);
we use that matrix, which is most likely what the figure was drawn with.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

import attn_ext as ae
from bench.harness.machine import load_average, machine_info, machine_markdown
from bench.harness.report import markdown_table, progress, publish
from bench.intention import command_line

NAME = "intention_regression_2d"
METHODS = ("Attention", "Linear Attention", "Intention", "σIntention")
#: The paper's printed key "covariance" (appendix §3); see :func:`key_covariance`.
PAPER_KEY_MATRIX = ((0.7, 0.9), (0.9, 1.0))
WEIGHT_VARIANCE = 10.0
INTERP_HALF_WIDTH, EXTRAP_HALF_WIDTH = 1.0, 25.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bench/out", help="directory for the report files (default: bench/out)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task drawn in the figure (default: 0)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--num-context", type=int, default=10,
                        help="context points (keys) per task; the paper does not say (default: 10)")
    parser.add_argument("--grid", type=int, default=41, help="queries per side of each square (default: 41)")
    parser.add_argument("--tasks", type=int, default=100,
                        help="further tasks (seeds seed+1...) averaged in the table (default: 100)")


def key_covariance():
    """The keys' covariance: the matrix absolute value of the paper's printed matrix.

    Returns
    -------
    numpy.ndarray
        ``[2, 2]``, symmetric positive definite: ``U |Λ| Uᵀ`` for ``PAPER_KEY_MATRIX = U Λ Uᵀ``.

    Examples
    --------
    >>> import numpy as np
    >>> c = key_covariance()
    >>> bool(np.all(np.linalg.eigvalsh(c) > 0)), round(float(c[0, 1] / np.sqrt(c[0, 0] * c[1, 1])), 2)
    (True, 0.93)
    """
    lam, u = np.linalg.eigh(np.asarray(PAPER_KEY_MATRIX, dtype=np.float64))
    return (u * np.abs(lam)) @ u.T


def sample_task(seed: int, num_context: int) -> dict:
    """One regression task of Fig. 4: weights, context keys and values (float64 numpy arrays).

    Returns
    -------
    dict
        ``w [2]``, ``keys [num_context, 2]``, ``values [num_context]`` with ``values = keys @ w``.
    """
    if num_context < 2:
        raise ValueError(f"regression_2d: num_context must be >= 2 for KᵀK to be invertible, got {num_context}")
    rng = np.random.default_rng(seed)
    w = rng.normal(0.0, np.sqrt(WEIGHT_VARIANCE), size=2)
    keys = rng.multivariate_normal(np.zeros(2), key_covariance(), size=num_context)
    return {"w": w, "keys": keys, "values": keys @ w}


def query_grid(half_width: float, points_per_side: int):
    """Queries over the square ``[-half_width, half_width]²``, row-major, ``[points_per_side², 2]``.

    A regular grid stands in for the paper's uniform draw: it covers the square evenly and is what
    the prediction images need.
    """
    axis = np.linspace(-half_width, half_width, points_per_side)
    xx, yy = np.meshgrid(axis, axis)
    return np.stack([xx.ravel(), yy.ravel()], axis=1)


def predict(method: str, queries, keys, values):
    """One of the four computations, untrained and at score scale 1 as in the paper, with attn_ext's ops.

    Parameters
    ----------
    method : str
        One of :data:`METHODS`.
    queries, keys : numpy.ndarray
        ``[M, 2]`` and ``[N, 2]``.
    values : numpy.ndarray
        ``[N]``.

    Returns
    -------
    numpy.ndarray
        ``[M]`` predictions.
    """
    # [1, 1, rows, features]: one batch entry and one head, float64 so the comparison is of the methods alone
    q, k = (torch.as_tensor(a, dtype=torch.float64).view(1, 1, *a.shape) for a in (queries, keys))
    v = torch.as_tensor(values, dtype=torch.float64).view(1, 1, -1, 1)
    with torch.no_grad():
        if method == "Attention":
            out = ae.cross_attention(q, k, v, scale=1.0)
        elif method == "Linear Attention":
            out = q @ (k.mT @ v)  # no attn_ext op computes the unnormalised product; plain torch
        elif method == "Intention":
            out = ae.intention(q, k, v, alpha=0.0)
        elif method == "σIntention":
            out = ae.sigma_intention(q, k, v, alpha=0.0)
        else:
            raise ValueError(f"regression_2d: unknown method {method!r}; expected one of {METHODS}")
    return out.view(-1).numpy()


def pearson(x, y) -> float:
    """Pearson correlation of two equal-length vectors (NaN when one of them is constant)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"pearson: expected two vectors of one shape, got {x.shape} and {y.shape}")
    dx, dy = x - x.mean(), y - y.mean()
    denom = np.sqrt((dx * dx).sum() * (dy * dy).sum())
    return float((dx * dy).sum() / denom) if denom > 0 else float("nan")


def evaluate_task(task: dict, points_per_side: int) -> dict:
    """Predictions, truths and Pearson r of every method, interpolation and extrapolation."""
    out = {}
    for regime, half in (("interp", INTERP_HALF_WIDTH), ("extrap", EXTRAP_HALF_WIDTH)):
        queries = query_grid(half, points_per_side)
        truth = queries @ task["w"]
        preds = {m: predict(m, queries, task["keys"], task["values"]) for m in METHODS}
        out[regime] = {"truth": truth, "pred": preds, "r": {m: pearson(truth, preds[m]) for m in METHODS}}
    return out


def tables(result: dict) -> str:
    cfg, fig, many = result["config"], result["figure_task"]["r"], result["mean_r"]
    rows = [[m, f"{fig['interp'][m]:.3f}", f"{fig['extrap'][m]:.3f}",
             f"{many['interp'][m]['mean']:.3f} ± {many['interp'][m]['std']:.3f}",
             f"{many['extrap'][m]['mean']:.3f} ± {many['extrap'][m]['std']:.3f}", PAPER_READING[m]]
            for m in METHODS]
    table = markdown_table(["method", "r interp (figure task)", "r extrap (figure task)",
                            f"r interp (mean ± std, {cfg['tasks']} tasks)", f"r extrap (mean ± std, {cfg['tasks']} tasks)",
                            "paper (Fig. 4 and its text)"], rows, align="lrrrrl")
    return "\n".join([
        f"Pearson correlation between prediction and truth of the four computations applied, untrained, to 2-D "
        f"linear regression: `w ~ N(0, {WEIGHT_VARIANCE:g} I)`, {cfg['num_context']} keys from the skewed Gaussian, "
        f"`V = K w`; queries on a {cfg['grid']}×{cfg['grid']} grid over [-1, 1]² (interpolation) and [-25, 25]² "
        f"(extrapolation). Score scale 1 and α = 0 as in the paper. The figure task is seed {cfg['seed']}; the "
        f"mean is over seeds {cfg['seed'] + 1}…{cfg['seed'] + cfg['tasks']}.",
        "",
        table,
        "",
        "The paper prints its correlations only inside the figure image; its text says that Intention and "
        "σIntention do \"perfectly well\" in interpolation while both attentions fail to capture the linear "
        "relation, and that the gap is larger in extrapolation. Linear Attention and Intention are linear in Q, "
        "and the extrapolation grid is the interpolation grid times 25, so their r is the same in both regimes.",
        "",
        f"Keys are drawn from {KEY_NOTE}. Wall time {result['wall_seconds']:.1f} s, one thread.",
        "",
        f"Command: `{cfg['command']}`",
        "",
        machine_markdown(result["machine"]),
    ])


#: What the paper's Fig. 4 and its text say of each method (the numbers are in the image only).
PAPER_READING = {
    "Attention": "fails to capture the linear relation; worse in extrapolation",
    "Linear Attention": "fails to capture the linear relation; worse in extrapolation",
    "Intention": "\"perfectly well\" (exact least squares)",
    "σIntention": "\"perfectly well\" in interpolation",
}
KEY_NOTE = ("|Σ| = U|Λ|Uᵀ of the paper's printed matrix [[0.7, 0.9], [0.9, 1.0]] (not a covariance: determinant "
            "-0.11), which is what NumPy's SVD-based sampler draws from when given it")


def plot(result: dict, path: Path) -> None:
    """Fig. 4's grid: rows interp image, interp scatter, extrap image, extrap scatter; one column per method."""
    # matplotlib is optional (figures only): imported when plotting, on the Agg backend (files, no display).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, fig_task = result["config"], result["figure_task"]
    g = cfg["grid"]
    keys, values = np.asarray(fig_task["keys"]), np.asarray(fig_task["values"])
    fig, axes = plt.subplots(4, len(METHODS) + 1, figsize=(3.0 * (len(METHODS) + 1), 12.0))
    for row, (regime, half) in enumerate((("interp", INTERP_HALF_WIDTH), ("extrap", EXTRAP_HALF_WIDTH))):
        truth = np.asarray(fig_task["truth"][regime])
        lo, hi = truth.min(), truth.max()
        img_ax, sc_ax = axes[2 * row], axes[2 * row + 1]
        extent = (-half, half, -half, half)
        img_ax[0].imshow(truth.reshape(g, g), origin="lower", extent=extent, cmap="viridis", vmin=lo, vmax=hi)
        img_ax[0].scatter(keys[:, 0], keys[:, 1], c=values, cmap="viridis", vmin=lo, vmax=hi, edgecolors="k", s=25)
        img_ax[0].set_title(f"truth + {len(values)} context ({regime})", fontsize=9)
        sc_ax[0].scatter(keys[:, 0], keys[:, 1], c=values, cmap="viridis", edgecolors="k", s=25)
        sc_ax[0].set_title("context keys (colour: value)", fontsize=9)
        for col, method in enumerate(METHODS, start=1):
            pred = np.asarray(fig_task["pred"][regime][method])
            r = fig_task["r"][regime][method]
            # each panel on its own colour range, as the direction of the fit is what the image shows; the
            # scatter below shows the scale (attention is bounded by the values' range)
            img_ax[col].imshow(pred.reshape(g, g), origin="lower", extent=extent, cmap="viridis")
            img_ax[col].set_title(f"{method} ({regime})\n[{pred.min():.3g}, {pred.max():.3g}]", fontsize=9)
            sc_ax[col].scatter(truth, pred, s=2, alpha=0.5)
            sc_ax[col].set_title(f"{method}: r = {r:.3f}", fontsize=9)
            sc_ax[col].set_xlabel("truth", fontsize=8)
            sc_ax[col].set_ylabel("prediction", fontsize=8)
    fig.suptitle("Fig. 4 reproduced: untrained computations on 2-D linear regression (rows: interpolation image, "
                 "its scatter, extrapolation image, its scatter; each image on its own colour range, "
                 "printed under its title)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    if args.grid < 2 or args.tasks < 1:
        raise ValueError(f"regression_2d: --grid must be >= 2 and --tasks >= 1, got {args.grid} and {args.tasks}")
    start = time.perf_counter()
    machine = machine_info()
    task = sample_task(args.seed, args.num_context)
    fig_eval = evaluate_task(task, args.grid)
    per_task = {"interp": {m: [] for m in METHODS}, "extrap": {m: [] for m in METHODS}}
    for i in range(1, args.tasks + 1):
        if i % 25 == 0:
            progress(f"regression_2d: task {i}/{args.tasks}")
        ev = evaluate_task(sample_task(args.seed + i, args.num_context), args.grid)
        for regime in per_task:
            for m in METHODS:
                per_task[regime][m].append(ev[regime]["r"][m])
    machine["load_average_end"] = load_average()
    command = command_line("regression_2d", args)
    result = {
        "benchmark": NAME, "machine": machine, "wall_seconds": time.perf_counter() - start,
        "config": {"seed": args.seed, "num_context": args.num_context, "grid": args.grid, "tasks": args.tasks,
                   "key_covariance": key_covariance().tolist(), "command": command},
        "figure_task": {"w": task["w"].tolist(), "keys": task["keys"].tolist(), "values": task["values"].tolist(),
                        "truth": {r: fig_eval[r]["truth"].tolist() for r in fig_eval},
                        "pred": {r: {m: fig_eval[r]["pred"][m].tolist() for m in METHODS} for r in fig_eval},
                        "r": {r: fig_eval[r]["r"] for r in fig_eval}},
        "mean_r": {r: {m: {"mean": float(np.nanmean(v)), "std": float(np.nanstd(v))} for m, v in ms.items()}
                   for r, ms in per_task.items()},
    }
    publish(NAME, tables(result), result, Path(args.out), plot)
    return 0
