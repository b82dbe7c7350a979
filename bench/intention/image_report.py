"""The report of ``python -m bench intention image_regression``: tables beside the paper's Figs. 7 and 13, a figure."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.intention.image_models import IMAGE_MODELS
from bench.intention.regression_report import closing_sections, lowest_trained_line, mse_table, plot_mse_curves
from bench.intention.report_common import pyplot

#: What the paper's Fig. 7 (MNIST panel), Fig. 13 and §5.1 say (its MSE values are in the figure images only).
PAPER_CLAIMS = (
    "Untrained, Intention's MSE with many observed pixels matches that of the trained models.",
    "Once trained, Intention and the baselines perform similarly.",
    "Fig. 13: the completed images of all trained models look alike.",
)


def _names() -> dict:
    return IMAGE_MODELS


def images_text(cfg: dict) -> str:
    """What the images were: the procedural glyphs (the default) or the file of ``--images``."""
    if cfg.get("data") is None:
        return (f"{cfg['side']}×{cfg['side']} procedurally drawn digit-like glyphs (an offline stand-in for MNIST, "
                "which cannot be downloaded here; see below)")
    return cfg["data"]


def tables(result: dict) -> str:
    cfg, rows, names = result["config"], result["rows"], _names()
    contexts = [str(n) for n in cfg["eval_context"]]
    mse = mse_table(result, names, 4)
    trained = [rows[m]["trained"] for m in cfg["models"]]
    top = contexts[-1]
    verdicts = []
    if "intention" in rows:
        untrained_top = rows["intention"]["untrained"][top]["mse"]
        beaten = [names[m] for m in cfg["models"]
                  if m != "intention" and rows[m]["trained"][top]["mse"] > untrained_top]
        verdicts.append(f"Untrained Intention at N = {top}: MSE {untrained_top:.4f}; trained models it beats there: "
                        f"{', '.join(beaten) or 'none'}.")
        spread = [max(t[n]["mse"] for t in trained) / min(t[n]["mse"] for t in trained) for n in contexts]
        verdicts.append("Ratio of the worst to the best trained MSE per N: "
                        + ", ".join(f"{n}: {r:.1f}×" for n, r in zip(contexts, spread)) + ".")
        others = [m for m in cfg["models"] if m != "intention"]
        if others:
            best = min(others, key=lambda m: rows[m]["trained"][top]["mse"])
            ratio = rows["intention"]["trained"][top]["mse"] / rows[best]["trained"][top]["mse"]
            held = "holds" if len(beaten) == len(others) else "holds in part" if beaten else "does not hold"
            # Which side is ahead decides the reading: the explanation must follow the numbers of this run.
            why = ("" if 0.67 < ratio < 1.5 else
                   "; at this budget the baselines have not learned to use many observations, so their curves "
                   "flatten out early" if ratio <= 0.67 else "")
            verdicts.append(
                f"**Against the paper:** its first claim {held} here ({len(beaten)} of {len(others)} trained "
                f"baselines beaten by untrained Intention at N = {top}); its second "
                f"{'holds' if 0.67 < ratio < 1.5 else 'does not'} (trained Intention's MSE at N = {top} is "
                f"{ratio:.2f}× the best trained baseline's, {names[best]}'s{why}).")
    differences = (
        f"Differences from the paper's setup: Fourier positional encoding with {cfg['frequencies']} octaves (the "
        f"paper adds \"positional encoding\" without saying which); hidden width {cfg['width']} everywhere (paper: "
        "Intention 1000, NP 2000, Attention and MAML 128); 4 attention heads (paper: 5); Adam "
        f"{cfg['lr']:g} for the amortised models (paper: 3e-4 / 1e-4 for 50 000 steps), MAML's outer 3e-3 and 3 "
        f"inner steps as in the paper with an inner rate of {cfg['maml_lr']:g} (paper: 0.1, which diverged on the "
        f"sine task here); Intention's ridge α learned from {cfg['alpha_init']:g} and σIntention's score scale "
        f"learned from {cfg['sigma_scale_init']:g} (as in our sine task).")
    return "\n".join([
        f"Image completion as regression on {images_text(cfg)}. Context: N random pixels "
        "(position in [-1, 1]², intensity in [0, 1]); targets: every pixel. Trained with "
        f"{cfg['train_context']} observed pixels, {cfg['steps']} steps of batch {cfg['batch']}, MLP width "
        f"{cfg['width']}, seed {cfg['seed']}; evaluated on {cfg['eval_images']} fixed images for each N. MSE over "
        f"all pixels ± standard error over images (the pixel variance is {result['pixel_variance']:.4f}: predicting "
        "the mean intensity scores that).",
        "",
        mse,
        "",
        lowest_trained_line(result, names),
        *verdicts,
        "",
        "**Beside the paper** (its Fig. 7, MNIST panel, plots these curves after 50 000 steps and Fig. 13 shows "
        "completed digits; its numbers are in the images only, so we compare its stated findings):",
        "",
        *[f"- Paper: {c}" for c in PAPER_CLAIMS],
        "",
        f"Where ours differ: the budget is {cfg['steps']} steps of {cfg['batch']} images, "
        f"{cfg['steps'] * cfg['batch'] / 50_000:.2g} of the images the paper's 50 000 steps of one image see, "
        "and the layers are 2–30 times narrower, so the trained MSEs are higher than they would be with the "
        "paper's budget, and the models that start from nothing (Attention, NP, MAML) lose the most from it. "
        + ("The images are not MNIST: the glyphs are ten jittered polyline digit templates with random rotation, "
         "shear, scale, shift and stroke width, rendered anti-aliased (thicker, cleaner strokes than handwriting, "
         "and fewer styles), so absolute MSEs are not comparable with the paper's; the comparison between the "
         "models and between untrained and trained is what carries over." if cfg.get("data") is None else
         "The images are those of the file named above; with MNIST they are the paper's."),
        "",
        *closing_sections(result, names, 4, differences),
    ])


def plot(result: dict, path: Path) -> None:
    """Top: MSE vs observed pixels (dashed untrained, solid trained; Fig. 7). Below: completions (Fig. 13)."""
    plt = pyplot()
    cfg, rows, names, shown = result["config"], result["rows"], _names(), result["figure_images"]
    contexts, models, side = [str(n) for n in cfg["eval_context"]], cfg["models"], cfg["side"]
    image = 0  # the first evaluation image, like one row of Fig. 13
    fig = plt.figure(figsize=(1.6 * len(contexts) * 2, 4.0 + 1.7 * (len(models) + 1)))
    grid = fig.add_gridspec(2 + len(models), 2 * len(contexts), height_ratios=[2.6] + [1.0] * (len(models) + 1))
    ax = fig.add_subplot(grid[0, :])
    plot_mse_curves(ax, result, names)
    ax.axhline(result["pixel_variance"], color="grey", lw=0.8, ls=":", label="pixel variance")
    ax.set_xlabel("number of observed pixels N")
    ax.set_ylabel(f"MSE over {side * side} pixels")
    ax.set_title(f"Fig. 7 (images): MSE vs observed pixels, dashed untrained, solid after {cfg['steps']} steps")
    ax.legend(fontsize=7, ncol=3)
    truth = np.array(shown["truth"][image])
    order = shown["pixel_order"][image]

    def show(a, img, title=None, label=None):
        a.imshow(img, cmap="gray", vmin=0, vmax=1, interpolation="nearest")
        a.set_xticks([])
        a.set_yticks([])
        if title:
            a.set_title(title, fontsize=8)
        if label:
            a.set_ylabel(label, fontsize=8)

    for c, n in enumerate(contexts):
        observed = np.full(side * side, np.nan)
        observed[order[:int(n)]] = truth.reshape(-1)[order[:int(n)]]
        a = fig.add_subplot(grid[1, 2 * c])
        a.set_facecolor((0.2, 0.3, 0.6))  # unobserved pixels show blue, as in the papers' figures
        show(a, observed.reshape(side, side), f"N = {n}: observed", "context" if c == 0 else None)
        show(fig.add_subplot(grid[1, 2 * c + 1]), truth, "truth")
        for r, m in enumerate(models, start=2):
            for k, state in enumerate(("untrained", "trained")):
                pred = np.clip(np.array(rows[m]["completions"][state][n][image]).reshape(side, side), 0, 1)
                show(fig.add_subplot(grid[r, 2 * c + k]), pred, state if r == 2 else None,
                     names[m] if c == 0 and k == 0 else None)
    images = "digit-like glyphs" if cfg.get("data") is None else cfg["data"].split(" (")[0]
    fig.suptitle(f"Image completion as regression on {images}: Fig. 7 (top) and Fig. 13 (one image)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)
