"""Model building blocks shared by the Intention experiments' model modules."""
from __future__ import annotations


def mlp(sizes, relu_last: bool = False):
    """Linear layers of ``sizes`` (input first) with ReLU between them (and after the last if ``relu_last``).

    Examples
    --------
    >>> mlp([2, 8, 1])
    Sequential(
      (0): Linear(in_features=2, out_features=8, bias=True)
      (1): ReLU()
      (2): Linear(in_features=8, out_features=1, bias=True)
    )
    """
    from torch import nn

    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2 or relu_last:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)
