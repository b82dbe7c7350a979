"""Synthetic few-shot classification episodes: the stand-in for MiniImageNet in the kernelised-size task.

The Intention paper's Figure 14 is 5-way 5-shot MiniImageNet (15 targets per class). No images can be
downloaded here, and a CPU cannot train a ResNet at that budget, so the episodes are drawn from a
small generative model with the same structure: a class is a set of ``modes`` points ("poses") in a
``latent_dim`` space, an example is one of its modes plus Gaussian noise, and a fixed random
two-layer tanh network (the "renderer", the same for every episode of a generator) maps it to the
observed ``obs_dim`` features. Every episode draws new classes, so the classes of evaluation are
never seen in training, as MiniImageNet's test classes are not. Several modes per class make the
classes' boundaries non-linear in the latent space, which is where a kernel can help a small
embedding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass
class Episodes:
    """A batch of episodes: context ``xc [B, ways·shots, obs_dim]`` with labels ``yc [B, ways·shots]``,
    targets ``xt [B, ways·queries, obs_dim]`` with labels ``yt``; ``zc``/``zt`` are the latent points
    before rendering and ``modes [B, ways, modes, latent_dim]`` the classes' mode centres (for tests)."""

    xc: Tensor
    yc: Tensor
    xt: Tensor
    yt: Tensor
    zc: Tensor
    zt: Tensor
    modes: Tensor


class EpisodeSampler:
    """Draws ``ways``-way ``shots``-shot episodes with ``queries`` targets per class.

    Parameters
    ----------
    ways, shots, queries : int
        The paper's MiniImageNet protocol by default: 5 classes, 5 context and 15 target images each.
    latent_dim, obs_dim : int
        Dimension of the class space and of the observed features.
    modes : int
        Modes per class; each example picks one uniformly.
    mode_spread, noise_std : float
        Mode centres are ``N(0, mode_spread² I)``; an example is its mode centre plus ``N(0, noise_std² I)``.
    renderer_seed : int
        Seed of the fixed renderer network (the "image formation" shared by all episodes).

    Examples
    --------
    >>> import torch
    >>> ep = EpisodeSampler().sample(2, generator=torch.Generator().manual_seed(0))
    >>> ep.xc.shape, ep.yt.shape
    (torch.Size([2, 25, 32]), torch.Size([2, 75]))
    """

    def __init__(self, ways: int = 5, shots: int = 5, queries: int = 15, *, latent_dim: int = 8, obs_dim: int = 32,
                 modes: int = 2, mode_spread: float = 1.0, noise_std: float = 0.35, renderer_seed: int = 1234) -> None:
        if min(ways, shots, queries, latent_dim, obs_dim, modes) < 1 or ways < 2:
            raise ValueError(f"EpisodeSampler: ways >= 2 and shots, queries, latent_dim, obs_dim, modes >= 1, got "
                             f"{ways}, {shots}, {queries}, {latent_dim}, {obs_dim}, {modes}")
        if not (mode_spread > 0 and noise_std >= 0):
            raise ValueError(f"EpisodeSampler: mode_spread > 0 and noise_std >= 0, got {mode_spread}, {noise_std}")
        self.ways, self.shots, self.queries = ways, shots, queries
        self.latent_dim, self.obs_dim, self.num_modes = latent_dim, obs_dim, modes
        self.mode_spread, self.noise_std = mode_spread, noise_std
        g = torch.Generator().manual_seed(renderer_seed)
        hidden = 2 * obs_dim
        # Scaled so that tanh is in its non-linear range for points of norm ~ sqrt(latent_dim).
        self.w1 = torch.randn(latent_dim, hidden, generator=g) * (1.5 / latent_dim ** 0.5)
        self.b1 = torch.randn(hidden, generator=g) * 0.5
        self.w2 = torch.randn(hidden, obs_dim, generator=g) / hidden ** 0.5

    def render(self, z: Tensor) -> Tensor:
        """The fixed renderer ``tanh(z W1 + b1) W2``: latent points ``[..., latent_dim]`` to ``[..., obs_dim]``."""
        return torch.tanh(z @ self.w1 + self.b1) @ self.w2

    def _draw(self, modes: Tensor, per_class: int, generator: Optional[torch.Generator]) -> tuple[Tensor, Tensor]:
        b = modes.shape[0]
        labels = torch.arange(self.ways).repeat_interleave(per_class).expand(b, -1)
        which = torch.randint(self.num_modes, (b, self.ways * per_class), generator=generator)
        centres = modes[torch.arange(b)[:, None], labels, which]
        z = centres + self.noise_std * torch.randn(centres.shape, generator=generator)
        return z, labels.clone()

    def sample(self, batch_size: int, generator: Optional[torch.Generator] = None) -> Episodes:
        """``batch_size`` independent episodes, each with newly drawn classes."""
        if batch_size < 1:
            raise ValueError(f"EpisodeSampler.sample: batch_size must be >= 1, got {batch_size}")
        modes = self.mode_spread * torch.randn(batch_size, self.ways, self.num_modes, self.latent_dim,
                                               generator=generator)
        zc, yc = self._draw(modes, self.shots, generator)
        zt, yt = self._draw(modes, self.queries, generator)
        return Episodes(self.render(zc), yc, self.render(zt), yt, zc, zt, modes)
