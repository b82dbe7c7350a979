"""Real embeddings for the classification and anomaly-detection tasks: a labelled bank of feature vectors.

The machines these benchmarks were built on cannot download MiniImageNet, CIFAR-100 or a pretrained
ResNet, so the tasks default to the synthetic :class:`bench.intention.embedding_data.EmbeddingWorld`.
Where the data exist, ``--features PATH`` reads a file saved with
``torch.save({"features": x, "labels": y}, PATH)`` (``x [n, dim]`` real, ``y [n]`` integer class ids),
for example frozen ResNet34 embeddings of CIFAR-100 (the anomaly experiment's own inputs, Table 3).

A :class:`FeatureBank` has the interface of the synthetic world (``classes(split)``, ``sample``,
``dim``), so the episode and outlier-set samplers use either. Classes are split *by class*, as the
paper's experiments are: in ascending label order, the first ``num_train_classes`` train and the rest
are the unseen test classes. The bank is finite, so the items of one draw are distinct
(``distinct_items``): an episode never shows a query that is also one of its context items.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from bench.intention.embedding_data import EmbeddingWorld, SplitByClass


class FeatureBank(SplitByClass):
    """Feature vectors ``features [n, dim]`` with class ids ``labels [n]``; see the module docstring.

    Parameters
    ----------
    features, labels : Tensor
        Finite real features and integer labels (any ids; relabelled ``0..C-1`` in ascending order).
    num_train_classes : int, optional
        Classes used for training (default: 80 % of them, rounded, at least 1 and at most C − 1).
    source : str
        Where the bank came from, for the reports.

    Examples
    --------
    >>> import torch
    >>> bank = FeatureBank(torch.randn(40, 3), torch.arange(40) % 10)
    >>> bank.num_classes, bank.num_train_classes, bank.dim
    (10, 8, 3)
    >>> x, rows = bank.sample(torch.tensor([[0, 0, 0, 9]]), torch.Generator().manual_seed(0))
    >>> x.shape, len(set(rows[0, :3].tolist()))
    (torch.Size([1, 4, 3]), 3)
    """

    distinct_items = True

    def __init__(self, features, labels, num_train_classes: Optional[int] = None, source: str = "in memory"):
        if not isinstance(features, torch.Tensor) or features.dim() != 2 or not features.is_floating_point():
            raise ValueError(f"FeatureBank: features must be a real [n, dim] tensor, got "
                             f"{getattr(features, 'shape', type(features).__name__)}")
        if not isinstance(labels, torch.Tensor) or labels.shape != features.shape[:1] or labels.is_floating_point():
            raise ValueError(f"FeatureBank: labels must be an integer [n] tensor matching features "
                             f"{tuple(features.shape)}, got {getattr(labels, 'shape', type(labels).__name__)}")
        if not bool(torch.isfinite(features).all()):
            raise ValueError("FeatureBank: features hold NaN or infinite values")
        ids, self.labels = torch.unique(labels.long(), sorted=True, return_inverse=True)
        self.num_classes = len(ids)
        if self.num_classes < 2:
            raise ValueError(f"FeatureBank: need at least 2 classes, got {self.num_classes}")
        if num_train_classes is None:
            num_train_classes = min(self.num_classes - 1, max(1, round(0.8 * self.num_classes)))
        if not 0 < num_train_classes < self.num_classes:
            raise ValueError(f"FeatureBank: need 0 < num_train_classes < {self.num_classes} classes, "
                             f"got {num_train_classes}")
        self.num_train_classes = int(num_train_classes)
        self.features = features.detach().double()
        self.dim = features.shape[1]
        self.source = source
        self.members = [torch.nonzero(self.labels == c).flatten() for c in range(self.num_classes)]

    @classmethod
    def load(cls, path, num_train_classes: Optional[int] = None) -> "FeatureBank":
        """The bank saved at ``path`` as ``{"features": [n, dim], "labels": [n]}`` (``torch.save``)."""
        data = torch.load(Path(path), map_location="cpu", weights_only=True)
        if not isinstance(data, dict) or not {"features", "labels"} <= set(data):
            raise ValueError(f"FeatureBank.load: {path} must hold a dict with 'features' [n, dim] and 'labels' [n] "
                             f"(torch.save({{'features': x, 'labels': y}}, path)), got "
                             f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
        return cls(data["features"], data["labels"], num_train_classes, source=Path(path).name)

    def describe(self) -> str:
        """One line for the reports: the source, its size, and the class split."""
        return (f"the features in `{self.source}` ({len(self.labels)} items of {self.num_classes} classes, "
                f"{self.dim}-d; {self.num_train_classes} training / {self.num_classes - self.num_train_classes} "
                "unseen test classes)")

    def sample(self, labels, generator=None, dtype=None):
        """Features ``[..., L, dim]`` of items of ``labels [..., L]`` and their bank rows ``[..., L]``.

        The items of one row (the last dimension) are distinct: each class's items are drawn without
        replacement. A class with fewer items than a row asks of it raises ``ValueError``.
        """
        dtype = dtype or torch.get_default_dtype()
        labels = torch.as_tensor(labels)
        if labels.dim() == 0 or labels.is_floating_point() or labels.numel() == 0 or \
                int(labels.min()) < 0 or int(labels.max()) >= self.num_classes:
            raise ValueError(f"FeatureBank.sample: labels must be a non-empty integer tensor in [0, "
                             f"{self.num_classes}), got dtype {labels.dtype}, shape {tuple(labels.shape)}")
        flat = labels.reshape(-1, labels.shape[-1])
        rows = torch.empty_like(flat)
        for r, row in enumerate(flat):
            for c in torch.unique(row).tolist():
                where = torch.nonzero(row == c).flatten()
                pool = self.members[c]
                if len(where) > len(pool):
                    raise ValueError(f"FeatureBank.sample: class {c} has {len(pool)} items, a draw needs "
                                     f"{len(where)} distinct ones")
                rows[r, where] = pool[torch.randperm(len(pool), generator=generator)[:len(where)]]
        rows = rows.reshape(labels.shape)
        return self.features[rows].to(dtype), rows


def add_feature_arguments(parser) -> None:
    """``--features`` and ``--train-classes``: the options that replace the synthetic data by a bank."""
    parser.add_argument("--features", type=Path, default=None,
                        help="a torch.save'd {'features': [n, dim], 'labels': [n]} of real embeddings to use instead "
                             "of the synthetic stand-in (then --dim and --separation are unused)")
    parser.add_argument("--train-classes", type=int, default=None,
                        help="with --features: classes used for training, the first in label order (default 80 %%)")


def world_from_args(args, separation: float):
    """The bank of ``args.features``, or the synthetic world of ``args.dim``, ``separation`` and ``args.seed``;
    with the ``config`` entries that say which (``data``: the bank's description or None, ``dim``)."""
    if getattr(args, "features", None) is not None:
        bank = FeatureBank.load(args.features, args.train_classes)
        return bank, {"data": bank.describe(), "dim": bank.dim, "train_classes": bank.num_train_classes,
                      "test_classes": bank.num_classes - bank.num_train_classes}
    if getattr(args, "train_classes", None) is not None:
        raise ValueError("--train-classes needs --features (the synthetic data have 80 training classes)")
    return EmbeddingWorld(dim=args.dim, separation=separation, seed=args.seed), {"data": None, "dim": args.dim}
