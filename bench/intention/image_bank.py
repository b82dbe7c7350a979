"""Real images for the image-regression task (``--images PATH``): MNIST or any set of square grey images.

The committed runs use procedural glyphs (:mod:`bench.intention.image_glyphs`) because MNIST cannot
be downloaded where they were made. Where it exists, ``--images PATH`` reads a file saved with
``torch.save({"train": x, "test": y}, PATH)``: ``x [n, side, side]`` and ``y [m, side, side]``, either
real intensities in [0, 1] or uint8 in 0 … 255 (MNIST's own format; divided by 255). Training draws
images uniformly from ``train``; the evaluation uses the first ``--eval-images`` of ``test``, images
never trained on, as the paper's MNIST test split.
"""
from __future__ import annotations

from pathlib import Path

import torch


class ImageBank:
    """Train and test images ``[n, side, side]`` with intensities in [0, 1]; see the module docstring.

    Examples
    --------
    >>> import torch
    >>> bank = ImageBank({"train": torch.randint(0, 256, (5, 4, 4), dtype=torch.uint8), "test": torch.rand(3, 4, 4)})
    >>> bank.side, tuple(bank.sample(2, torch.Generator().manual_seed(0)).shape), float(bank.train.max()) <= 1
    (4, (2, 4, 4), True)
    """

    def __init__(self, data: dict, source: str = "in memory"):
        if not isinstance(data, dict) or not {"train", "test"} <= set(data):
            raise ValueError("ImageBank: need a dict with 'train' [n, side, side] and 'test' [m, side, side] images "
                             f"(torch.save({{'train': x, 'test': y}}, path)), got "
                             f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
        split = {}
        for name in ("train", "test"):
            images = data[name]
            if not isinstance(images, torch.Tensor) or images.dim() != 3 or images.shape[1] != images.shape[2] \
                    or images.shape[0] < 1 or images.shape[1] < 2:
                raise ValueError(f"ImageBank: '{name}' must be a tensor [n >= 1, side, side] of square images, got "
                                 f"{getattr(images, 'shape', type(images).__name__)}")
            if images.dtype == torch.uint8:
                images = images.double() / 255
            elif not images.is_floating_point():
                raise ValueError(f"ImageBank: '{name}' must be uint8 (0 … 255) or real in [0, 1], got {images.dtype}")
            images = images.double()
            if not bool(torch.isfinite(images).all()) or float(images.min()) < 0 or float(images.max()) > 1:
                raise ValueError(f"ImageBank: '{name}' intensities must be finite and in [0, 1] (or uint8)")
            split[name] = images
        if split["train"].shape[1:] != split["test"].shape[1:]:
            raise ValueError(f"ImageBank: train and test images differ in size: {tuple(split['train'].shape[1:])} "
                             f"and {tuple(split['test'].shape[1:])}")
        self.train, self.test = split["train"], split["test"]
        self.side = self.train.shape[1]
        self.source = source

    @classmethod
    def load(cls, path) -> "ImageBank":
        return cls(torch.load(Path(path), map_location="cpu", weights_only=True), source=Path(path).name)

    def describe(self) -> str:
        """One line for the reports: the source and its size."""
        return (f"the images in `{self.source}` ({len(self.train)} training and {len(self.test)} test images, "
                f"{self.side}×{self.side})")

    def sample(self, batch: int, generator):
        """``batch`` training images drawn uniformly (with replacement), ``[batch, side, side]`` in float32."""
        index = torch.randint(len(self.train), (batch,), generator=generator)
        return self.train[index].float()

    def evaluation(self, count: int):
        """The first ``count`` test images (all of them if fewer), ``[count, side, side]`` in float32."""
        return self.test[:count].float()
