"""Image completion tasks (CMANP §4.1, docs/spec.md §6): pixels as points, a random context/target split.

An image ``[C, H, W]`` with values in [0, 1] becomes ``H·W`` points: ``x`` = the pixel's (row,
column) scaled to [−1, 1], ``y`` = its value − 0.5 per channel. Per batch, as the official TNP/LBANP/
CMANP code, ``N_c ~ U[3, M − 3)`` and ``N_t ~ U[3, M − N_c)`` shared by every image, with ``M`` = 200
at 32×32, 800 at 64×64 and 1600 at 128×128 (``min(H·W, 200)`` at other sizes); each image gets its own
random permutation of pixels, the first ``N_c`` being the context and the next ``N_t`` the targets.

Datasets (:data:`DATASETS`): ``emnist`` (32×32, train on classes 0–9; evaluation splits ``seen`` =
test classes 0–9, ``unseen`` = test classes 10–46), ``celeba32/64/128`` (train/valid/test partitions),
``digits`` (scikit-learn's 8×8 digits, offline; train/test).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from attn_ext.data import NPBatch
from bench.np.data.image_files import load_celeba, load_digits, load_emnist

#: Resolution -> M, the bound on N_c + N_t of the papers (N_c < M − 3, N_c + N_t < M).
MAX_POINTS = {32: 200, 64: 800, 128: 1600}


def max_points(height: int, width: int) -> int:
    """``M`` of an image size: the papers' value at 32/64/128, else ``min(H·W, 200)``."""
    if height == width and height in MAX_POINTS:
        return MAX_POINTS[height]
    return min(height * width, 200)


def pixel_coordinates(height: int, width: int) -> Tensor:
    """``[H·W, 2]`` (row, column) of every pixel in row-major order, each scaled to [−1, 1]."""
    rows = torch.linspace(-1.0, 1.0, height) if height > 1 else torch.zeros(1)
    cols = torch.linspace(-1.0, 1.0, width) if width > 1 else torch.zeros(1)
    return torch.cartesian_prod(rows, cols)


def image_points(images: Tensor) -> Tuple[Tensor, Tensor]:
    """``(x [H·W, 2], y [B, H·W, C])`` of images ``[B, C, H, W]`` (uint8 in 0..255 or float in [0, 1])."""
    if images.dim() != 4:
        raise ValueError(f"images must be [B, C, H, W], got {tuple(images.shape)}")
    values = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    B, C, H, W = values.shape
    return pixel_coordinates(H, W), values.permute(0, 2, 3, 1).reshape(B, H * W, C) - 0.5


class ImageCompletionSampler:
    """Draws batches of image completion tasks from a fixed set of images.

    Parameters
    ----------
    images : Tensor
        ``[N, C, H, W]``, uint8 (0..255) or float in [0, 1].
    max_total : int, optional
        ``M`` (default :func:`max_points` of the image size).

    Examples
    --------
    >>> import torch
    >>> from bench.np.data.images import ImageCompletionSampler
    >>> sampler = ImageCompletionSampler(torch.randint(0, 256, (10, 3, 32, 32), dtype=torch.uint8))
    >>> batch = sampler.sample(4, generator=torch.Generator().manual_seed(0))
    >>> batch.xc.shape[-1], batch.yc.shape[-1], 3 <= batch.xc.shape[1] < 197
    (2, 3, True)
    """

    def __init__(self, images: Tensor, max_total: Optional[int] = None) -> None:
        if not isinstance(images, Tensor) or images.dim() != 4 or images.shape[0] == 0:
            got = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
            raise ValueError(f"images must be a non-empty [N, C, H, W] tensor, got {got}")
        _, C, H, W = images.shape
        self.images, self.channels = images, C
        self.max_total = max_total or max_points(H, W)
        if not 9 < self.max_total <= H * W:
            raise ValueError(f"max_total must be in (9, H·W = {H * W}], got {self.max_total}")

    def __len__(self) -> int:
        return self.images.shape[0]

    def sample_counts(self, generator: Optional[torch.Generator] = None) -> Tuple[int, int]:
        """``(N_c, N_t)``: ``randint(3, M − 3)`` then ``randint(3, M − N_c)``, as the official code."""
        num_ctx = int(torch.randint(3, self.max_total - 3, (1,), generator=generator))
        num_tar = int(torch.randint(3, self.max_total - num_ctx, (1,), generator=generator))
        return num_ctx, num_tar

    def tasks(self, images: Tensor, generator: Optional[torch.Generator] = None, *,
              num_context: Optional[int] = None, num_target: Optional[int] = None) -> NPBatch:
        """The tasks of the given ``images [B, C, H, W]`` with fresh counts (or the ones given)."""
        num_ctx, num_tar = self.sample_counts(generator)
        num_ctx, num_tar = num_context or num_ctx, num_target or num_tar
        x, y = image_points(images)
        B, n = y.shape[:2]
        if num_ctx + num_tar > n:
            raise ValueError(f"N_c + N_t = {num_ctx + num_tar} exceeds the {n} pixels of an image")
        order = torch.rand(B, n, generator=generator).argsort(dim=1)[:, :num_ctx + num_tar]
        xs = x[order]                                              # [B, N_c + N_t, 2]
        ys = y.gather(1, order.unsqueeze(-1).expand(-1, -1, y.shape[-1]))
        return NPBatch(xs[:, :num_ctx], ys[:, :num_ctx], xs[:, num_ctx:], ys[:, num_ctx:])

    def sample(self, batch_size: int, generator: Optional[torch.Generator] = None, **counts) -> NPBatch:
        """``batch_size`` tasks of images drawn uniformly (with replacement) from the set."""
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        index = torch.randint(0, len(self), (batch_size,), generator=generator)
        return self.tasks(self.images[index], generator, **counts)


class ImageDataset(NamedTuple):
    """A named dataset: its image size, channels, splits and the loader ``(data_dir, split) -> uint8``."""

    size: int
    channels: int
    train_split: str
    eval_splits: Tuple[str, ...]
    load: Callable[[Optional[Path], str], Tensor]


def _emnist(data_dir: Optional[Path], split: str) -> Tensor:
    if split not in ("train", "seen", "unseen"):
        raise ValueError(f"EMNIST split must be train, seen or unseen, got {split!r}")
    classes = range(10, 47) if split == "unseen" else range(10)
    return load_emnist(_need_dir(data_dir, "emnist"), "train" if split == "train" else "test", classes)[0]


def _celeba(size: int) -> Callable[[Optional[Path], str], Tensor]:
    return lambda data_dir, split: load_celeba(_need_dir(data_dir, f"celeba{size}"), split, size)


def _need_dir(data_dir: Optional[Path], name: str) -> Path:
    if data_dir is None:
        raise ValueError(f"dataset {name!r} is read from local files: pass --data-dir")
    return Path(data_dir)


DATASETS: Dict[str, ImageDataset] = {
    "emnist": ImageDataset(32, 1, "train", ("seen", "unseen"), _emnist),
    **{f"celeba{s}": ImageDataset(s, 3, "train", ("test",), _celeba(s)) for s in (32, 64, 128)},
    "digits": ImageDataset(8, 1, "train", ("test",), lambda data_dir, split: load_digits(split)[0]),
}


def load_images(name: str, split: str, data_dir: Optional[Path] = None) -> Tensor:
    """``uint8 [N, C, H, W]`` of dataset ``name`` (a key of :data:`DATASETS`) and ``split``."""
    if name not in DATASETS:
        raise ValueError(f"unknown image dataset {name!r}; choose one of {', '.join(DATASETS)}")
    return DATASETS[name].load(data_dir, split)
