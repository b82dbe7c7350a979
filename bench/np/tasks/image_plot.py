"""Figure of image completions: per image the original, the context pixels, the predictive mean and
the predictive std at every pixel (matplotlib, Agg backend, imported lazily)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from bench.np.checkpoint import load_checkpoint
from bench.np.data.images import DATASETS, image_points
from bench.np.tasks.np_tasks import image_task

#: Colour of the pixels outside the context in the "context" column (a blue no image contains much of).
_HIDDEN = torch.tensor([0.15, 0.25, 0.6])


@torch.no_grad()
def completions(model, sampler, num_images: int, num_context: Optional[int] = None, seed: int = 0):
    """``(original, context, mean, std)``, each float ``[n, H, W, 3]`` in [0, 1] (std scaled to its max).

    The first ``num_images`` images of ``sampler`` with ``num_context`` random context pixels (default
    ``M / 4``, a quarter of the papers' largest N_c + N_t); the model predicts every pixel.
    """
    images = sampler.images[:num_images]
    n, C, H, W = images.shape
    x, y = image_points(images)
    gen = torch.Generator().manual_seed(seed)
    num_context = num_context or sampler.max_total // 4
    order = torch.rand(n, H * W, generator=gen).argsort(1)[:, :num_context]
    xc, yc = x[order], y.gather(1, order.unsqueeze(-1).expand(-1, -1, C))
    model.eval()
    pred = model.marginals(xc, yc, x.expand(n, -1, -1))

    def picture(values):  # [n, H·W, C] in [0, 1] -> [n, H, W, 3]
        v = values.clamp(0, 1).reshape(n, H, W, C)
        return v.expand(-1, -1, -1, 3) if C == 1 else v

    context = _HIDDEN.expand(n, H * W, 3).clone()
    context.scatter_(1, order.unsqueeze(-1).expand(-1, -1, 3), (yc + 0.5).clamp(0, 1).expand(-1, -1, 3))
    std = pred.stddev
    return (picture(y + 0.5), context.reshape(n, H, W, 3), picture(pred.mean + 0.5),
            picture(std / std.max().clamp_min(1e-12)))


def plot_completions(model, sampler, path: Path, num_images: int = 4, title: str = "") -> Path:
    """Write the completions of ``num_images`` images of ``sampler`` to ``path`` (PNG); returns it."""
    # matplotlib is optional (figures only): imported when plotting, on the Agg backend (files, no display).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    num_images = min(num_images, len(sampler))
    panels = completions(model, sampler, num_images)
    names = ("image", f"context ({sampler.max_total // 4} px)", "mean", "std (scaled)")
    fig, axes = plt.subplots(num_images, 4, figsize=(6, 1.6 * num_images), squeeze=False)
    for i in range(num_images):
        for j, panel in enumerate(panels):
            ax = axes[i][j]
            ax.imshow(panel[i].numpy(), interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_title(names[j], fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(run_dir: Path, num_images: int = 4) -> Path:
    """``completions.png`` in ``run_dir``: the run's model on its dataset's first evaluation split."""
    model, ckpt = load_checkpoint(Path(run_dir))
    dataset = ckpt["dataset"]
    split = DATASETS[dataset].eval_splits[0]
    sampler = image_task(dataset, Path(ckpt["data_dir"]) if ckpt.get("data_dir") else None, split).sampler
    title = f"{ckpt['model']} on {dataset} ({split}), step {ckpt['step']}"
    return plot_completions(model, sampler, Path(run_dir) / "completions.png", num_images, title)
