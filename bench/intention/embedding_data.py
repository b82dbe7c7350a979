"""Synthetic class-conditional embeddings: the offline stand-in for MiniImageNet and CIFAR-100 features.

The Intention paper's classification (§5.2) and anomaly-detection (§5.5) experiments read images
through an encoder (a convolutional net trained end to end, or a frozen ResNet34). Neither data set
can be fetched here, so both tasks draw "images" from a fixed random feature model that keeps what
those experiments depend on: many classes split *by class* into training and test classes (so test
episodes show classes never seen in training), class structure that is only partly visible in the
raw features, and within-class variation that an encoder must learn to discount.

The model, fixed by ``seed``:

* every class ``c`` has a centre ``μ_c ~ N(0, separation² I)`` in a ``latent_dim``-dimensional
  class space;
* an item of class ``c`` has latent ``z = [μ_c + ε ; u]`` with ``ε ~ N(0, I_latent)`` (within-class
  variation) and ``u ~ N(0, nuisance_std² I_nuisance)`` (class-independent "pose/lighting" factors,
  stronger than the class signal, so raw distances are dominated by nuisance);
* its features are ``x = relu(A z + b)`` with a fixed Gaussian ``A`` (scaled by ``1/sqrt(len(z))``)
  and bias ``b``: non-negative like pooled post-ReLU CNN features, and a non-linear mixture of class
  and nuisance factors that a learned encoder can partly undo.

Items are drawn afresh for every episode (an unbounded pool per class, unlike the 600 images of a
MiniImageNet class); the class split follows the papers: the first ``num_train_classes`` classes
train, the rest test. The samplers below also take a :class:`bench.intention.feature_bank.FeatureBank`
of real embeddings in place of the world.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


class SplitByClass:
    """The papers' split by class: ids ``0 .. num_train_classes − 1`` train, the rest up to ``num_classes`` test."""

    num_classes: int
    num_train_classes: int

    def classes(self, split: str):
        """The class ids of ``split`` ("train" or "test") as a tensor."""
        if split == "train":
            return torch.arange(self.num_train_classes)
        if split == "test":
            return torch.arange(self.num_train_classes, self.num_classes)
        raise ValueError(f"{type(self).__name__}: split must be 'train' or 'test', got {split!r}")


@dataclass
class EmbeddingWorld(SplitByClass):
    """The fixed random feature model (see the module docstring).

    Parameters
    ----------
    num_classes, num_train_classes : int
        Classes in all and those used for training (the rest are the unseen test classes).
    latent_dim, nuisance_dim, dim : int
        Sizes of the class space, of the nuisance factors, and of the observed features.
    separation : float
        Standard deviation of the class centres (within-class variation has standard deviation 1).
    nuisance_std : float
        Standard deviation of the nuisance factors.
    seed : int
        Fixes the centres, ``A`` and ``b``.

    Examples
    --------
    >>> import torch
    >>> world = EmbeddingWorld(num_classes=10, num_train_classes=8, dim=12, seed=0)
    >>> x, z = world.sample(torch.tensor([[0, 9]]), torch.Generator().manual_seed(0))
    >>> x.shape, z.shape, bool((x >= 0).all())
    (torch.Size([1, 2, 12]), torch.Size([1, 2, 24]), True)
    """

    num_classes: int = 100
    num_train_classes: int = 80
    latent_dim: int = 16
    nuisance_dim: int = 8
    dim: int = 64
    separation: float = 1.0
    nuisance_std: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.num_train_classes < self.num_classes:
            raise ValueError(f"EmbeddingWorld: need 0 < num_train_classes < num_classes, got "
                             f"{self.num_train_classes}, {self.num_classes}")
        if min(self.latent_dim, self.nuisance_dim, self.dim) < 1 or self.separation <= 0 or self.nuisance_std < 0:
            raise ValueError(f"EmbeddingWorld: sizes must be >= 1, separation > 0, nuisance_std >= 0; got "
                             f"{self.latent_dim}, {self.nuisance_dim}, {self.dim}, {self.separation}, "
                             f"{self.nuisance_std}")
        gen = torch.Generator().manual_seed(self.seed)
        width = self.latent_dim + self.nuisance_dim
        self.centres = self.separation * torch.randn(self.num_classes, self.latent_dim, generator=gen,
                                                     dtype=torch.float64)
        self.mixing = torch.randn(self.dim, width, generator=gen, dtype=torch.float64) / width ** 0.5
        self.bias = 0.5 * torch.randn(self.dim, generator=gen, dtype=torch.float64)

    def sample(self, labels, generator=None, dtype=None):
        """Features ``x [..., dim]`` and latents ``z [..., latent_dim + nuisance_dim]`` of items of ``labels``."""
        dtype = dtype or torch.get_default_dtype()
        labels = torch.as_tensor(labels)
        if labels.dtype not in (torch.int32, torch.int64) or labels.numel() == 0 or \
                int(labels.min()) < 0 or int(labels.max()) >= self.num_classes:
            raise ValueError(f"EmbeddingWorld.sample: labels must be non-empty integers in [0, {self.num_classes}), "
                             f"got dtype {labels.dtype}, shape {tuple(labels.shape)}")
        noise = torch.randn(*labels.shape, self.latent_dim, generator=generator, dtype=torch.float64)
        nuisance = self.nuisance_std * torch.randn(*labels.shape, self.nuisance_dim, generator=generator,
                                                   dtype=torch.float64)
        z = torch.cat([self.centres[labels] + noise, nuisance], -1)
        x = torch.relu(z @ self.mixing.T + self.bias)
        return x.to(dtype), z.to(dtype)


def _pick_classes(world: EmbeddingWorld, batch: int, count: int, split: str, generator):
    """``[batch, count]`` distinct classes of ``split`` per row (a random subset in random order)."""
    pool = world.classes(split)
    if count > len(pool):
        raise ValueError(f"need {count} distinct {split} classes, the world has {len(pool)}")
    order = torch.rand(batch, len(pool), generator=generator).argsort(-1)[:, :count]
    return pool[order]


def sample_episodes(world: EmbeddingWorld, batch: int, *, ways: int = 5, shots: int = 5, queries: int = 15,
                    split: str = "train", generator=None):
    """``batch`` few-shot episodes: ``ways`` classes, ``shots`` context and ``queries`` target items each.

    Returns
    -------
    xc, yc, xq, yq : Tensor
        Context features ``[B, ways·shots, dim]`` and episode labels ``[B, ways·shots]`` in
        ``0..ways-1``; query features ``[B, ways·queries, dim]`` and labels. Items are ordered by
        episode label (the models are permutation invariant over the context).
    """
    if min(batch, ways, shots, queries) < 1:
        raise ValueError(f"sample_episodes: batch, ways, shots, queries must be >= 1, got "
                         f"{batch}, {ways}, {shots}, {queries}")
    chosen = _pick_classes(world, batch, ways, split, generator)               # [B, ways]
    yc = torch.arange(ways).repeat_interleave(shots).expand(batch, -1)
    yq = torch.arange(ways).repeat_interleave(queries).expand(batch, -1)
    if getattr(world, "distinct_items", False):
        # A finite bank (bench.intention.feature_bank): one draw, so no query repeats a context item.
        x, _ = world.sample(torch.cat([chosen.gather(1, yc), chosen.gather(1, yq)], 1), generator)
        xc, xq = x[:, :ways * shots], x[:, ways * shots:]
    else:
        xc, _ = world.sample(chosen.gather(1, yc), generator)
        xq, _ = world.sample(chosen.gather(1, yq), generator)
    return xc, yc.contiguous(), xq, yq.contiguous()


def sample_outlier_sets(world: EmbeddingWorld, batch: int, *, set_size: int = 10, split: str = "train",
                        generator=None):
    """``batch`` sets of ``set_size`` items: all of one class but one item (the outlier) of another.

    Returns
    -------
    x : Tensor
        ``[B, set_size, dim]`` features.
    outlier : Tensor
        ``[B]`` position of the outlier (uniform over the set).
    """
    if batch < 1 or set_size < 2:
        raise ValueError(f"sample_outlier_sets: need batch >= 1 and set_size >= 2, got {batch}, {set_size}")
    pair = _pick_classes(world, batch, 2, split, generator)                   # inlier class, outlier class
    outlier = torch.randint(set_size, (batch,), generator=generator)
    is_outlier = torch.arange(set_size)[None] == outlier[:, None]
    labels = torch.where(is_outlier, pair[:, 1:], pair[:, :1])
    x, _ = world.sample(labels, generator)
    return x, outlier
