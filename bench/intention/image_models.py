"""The Intention paper's few-shot regressors (appendix §4.1) on pixel positions, for image completion.

The paper reuses its sine-regression architectures for MNIST "but add[s] positional encoding to the
pixel positions". It does not say which encoding; we use Fourier features: a position ``p ∈ [-1, 1]²``
becomes ``[p, sin(2^k π p), cos(2^k π p)]`` for ``k = 0 … frequencies − 1``. Each model maps a
context ``(xc [B, N, 2], yc [B, N, 1])`` and queries ``xt [B, M, 2]`` to intensities ``[B, M, 1]``
and is trained with their MSE. The paper's layer sizes are those of the sine task (see
:mod:`bench.intention.sine_models`); ``width`` replaces them here to fit a CPU budget.
"""
from __future__ import annotations

import math

import torch

from bench.intention.few_shot_regressors import build_few_shot_regressor, check_context_shapes, check_regressor_options

#: Model names in the order of the report, with the paper's name.
IMAGE_MODELS = {"intention": "Intention", "sigma_intention": "σIntention", "attention": "Attention",
                "np": "Neural Process", "maml": "MAML"}


def fourier_features(p, frequencies: int):
    """``[p, sin(2^k π p), cos(2^k π p)]_k``: ``[..., 2] -> [..., 2 + 4·frequencies]``."""
    scales = (2.0 ** torch.arange(frequencies, dtype=p.dtype)) * math.pi
    angles = (p.unsqueeze(-1) * scales).flatten(-2)
    return torch.cat([p, torch.sin(angles), torch.cos(angles)], -1)


def build_image_model(name: str, width: int = 64, *, frequencies: int = 4, heads: int = 4, maml_steps: int = 3,
                      maml_lr: float = 0.01, alpha_init: float = 0.01, sigma_scale_init: float = 10.0):
    """A fresh model of :data:`IMAGE_MODELS` reading positional encodings of 2-D pixel positions:
    a ``torch.nn.Module``, ``model(xc, yc, xt) -> [B, M, 1]``.

    Parameters
    ----------
    name : str
        Key of :data:`IMAGE_MODELS`.
    width : int
        Hidden width of every MLP (the paper: 1000 for Intention, 2000 for the NP, 128 otherwise).
    frequencies : int
        Octaves of the Fourier positional encoding (the paper does not state its encoding).
    heads, maml_steps, maml_lr, alpha_init, sigma_scale_init
        As in :func:`bench.intention.sine_models.build_sine_model`.

    Examples
    --------
    >>> import torch
    >>> xc, yc, xt = torch.rand(2, 5, 2), torch.rand(2, 5, 1), torch.rand(2, 7, 2)
    >>> [tuple(build_image_model(n, 16)(xc, yc, xt).shape) for n in IMAGE_MODELS]
    [(2, 7, 1), (2, 7, 1), (2, 7, 1), (2, 7, 1), (2, 7, 1)]
    """
    def encode(xc, yc, xt, cls):
        check_context_shapes(xc, yc, xt, cls, positions=2)
        return fourier_features(xc, frequencies), fourier_features(xt, frequencies)

    check_regressor_options("build_image_model", name, width, heads=heads,
                            positive={"alpha_init": alpha_init, "sigma_scale_init": sigma_scale_init},
                            non_negative={"maml_steps": maml_steps, "frequencies": frequencies})
    return build_few_shot_regressor(name, width, dim=2 + 4 * frequencies, prepare=encode, heads=heads,
                                    maml_steps=maml_steps, maml_lr=maml_lr, alpha_init=alpha_init,
                                    sigma_scale_init=sigma_scale_init)
