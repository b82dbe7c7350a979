"""ConvNP: the convolutional conditional NP (ConvCNP) baseline of the efficient-NP-transformers chapter.

Gordon et al. 2020, "Convolutional Conditional Neural Processes": the context is set-convolved onto a
uniform grid (a density channel and the density-normalised ``y``), a CNN runs on the grid, and a
second set convolution reads the result at the targets. Every step sees inputs only through
differences ``x − g`` to a grid that moves with the data, so the model is translation equivariant.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
from torch import Tensor, nn
from torch.distributions import Normal

from attn_ext.models.base import GaussianHead, NeuralProcess, NPConfig, check_points
from attn_ext.models.set_conv import grid_to_points, points_to_grid

#: Above this many grid points ConvNP refuses to run: one grid activation alone would take gigabytes.
MAX_GRID_POINTS = 2 ** 24


class UNet(nn.Module):
    """A UNet on a ``dim_x``-D grid: ``levels`` stride-2 convolutions down, as many transposed ones up,
    each up step concatenated with the down path's activation of the same size, then a 1×1 convolution.

    All levels keep ``channels`` channels; any grid size works (the transposed convolutions are told
    the size of the activation they pair with, so no grid has to be padded to a power of two).
    """

    def __init__(self, dim_x: int, channels: int, levels: int, kernel_size: int) -> None:
        super().__init__()
        conv, conv_t = (nn.Conv1d, nn.ConvTranspose1d) if dim_x == 1 else (nn.Conv2d, nn.ConvTranspose2d)
        pad = kernel_size // 2
        self.down = nn.ModuleList(conv(channels, channels, kernel_size, stride=2, padding=pad) for _ in range(levels))
        self.up = nn.ModuleList(conv_t(channels if i == 0 else 2 * channels, channels, kernel_size, stride=2,
                                       padding=pad) for i in range(levels))
        self.out = conv(2 * channels, channels, 1)

    def forward(self, h: Tensor) -> Tensor:
        skips = [h]
        for layer in self.down:
            h = torch.relu(layer(h))
            skips.append(h)
        skips.pop()  # the deepest activation is h itself
        for layer in self.up:
            skip = skips.pop()
            h = torch.cat([torch.relu(layer(h, output_size=skip.shape[2:])), skip], 1)
        return self.out(h)


class ConvNP(NeuralProcess):
    """ConvCNP: SetConv encoder → UNet on a grid → SetConv decoder → Gaussian head.

    Deterministic (conditional) model: no latent variable, one diagonal Gaussian per target. Not
    linear in memory: the grid covers the range of the context and target inputs of every task at
    ``points_per_unit`` points per unit of x, so memory grows with the extent of the data (and,
    for ``dim_x = 2``, with its square), roughly constant in ``N_c`` and ``N_t`` for a fixed range.

    The grid of each task starts at that task's smallest input minus ``margin`` (per dimension) and
    steps by ``1 / points_per_unit``, so shifting a task's inputs by any vector shifts its grid by the
    same vector and leaves the predictions unchanged (up to rounding of ``x − grid``). All tasks of a
    batch share the number of grid points (that of the widest task), so a task's prediction near
    the far edge of its grid may depend slightly on the other tasks of its batch, as with the
    batch-wide grid of the original ConvCNP code.

    Sizes: ``d_model`` channels throughout the UNet, ``num_layers`` down/up levels, ``ff_dim`` the
    head's hidden width; ``num_heads``, ``emb_depth`` and ``num_latents`` are unused. At the
    defaults (64 channels, 6 levels) this is about 0.37M parameters for ``dim_x = 1`` (kernel 5) and
    0.64M for ``dim_x = 2`` (kernel 3, 3×3 convolutions), in the range of the chapter's ~1M-parameter
    models. ``points_per_unit = 64`` and the initial RBF length scale ``2 / points_per_unit`` are
    Gordon et al.'s 1-D GP values; the margin 0.1 is theirs too.

    Parameters
    ----------
    config, **overrides
        Sizes (:class:`~attn_ext.models.NPConfig`); ``dim_x`` must be 1 or 2.
    points_per_unit : float
        Grid density per unit of x (default 64).
    margin : float
        Extra extent of the grid beyond the data on each side (default 0.1).
    kernel_size : int, optional
        Odd convolution width; default 5 for ``dim_x = 1`` and 3 for ``dim_x = 2``.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.models import ConvNP
    >>> model = ConvNP(d_model=16, num_layers=2, points_per_unit=16)
    >>> xc, yc, xt = torch.randn(2, 10, 1), torch.randn(2, 10, 1), torch.randn(2, 7, 1)
    >>> pred = model.predict(xc, yc, xt)
    >>> pred.mean.shape, bool((pred.scale > 0).all())
    (torch.Size([2, 7, 1]), True)
    >>> shifted = model.predict(xc + 3.0, yc, xt + 3.0)
    >>> torch.allclose(pred.mean, shifted.mean, atol=1e-4)
    True
    """

    def __init__(self, config: Optional[NPConfig] = None, *, points_per_unit: float = 64.0, margin: float = 0.1,
                 kernel_size: Optional[int] = None, **overrides) -> None:
        super().__init__(config, **overrides)
        c = self.config
        if c.dim_x not in (1, 2):
            raise ValueError(f"ConvNP: dim_x must be 1 or 2 (Conv1d/Conv2d grids), got dim_x={c.dim_x}")
        if kernel_size is None:
            kernel_size = 5 if c.dim_x == 1 else 3
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"ConvNP: kernel_size must be odd and positive, got {kernel_size}")
        if not points_per_unit > 0 or not margin >= 0:
            raise ValueError(f"ConvNP: need points_per_unit > 0 and margin >= 0, got {points_per_unit}, {margin}")
        if c.num_layers < 1:
            raise ValueError(f"ConvNP: num_layers (UNet levels) must be >= 1, got {c.num_layers}")
        self.points_per_unit, self.margin, self.kernel_size = float(points_per_unit), float(margin), kernel_size
        # Absolute inputs must never reach the features of a translation-equivariant model, so the
        # base class's [x, y] embedder is dropped.
        self.embedder = None
        init_log_length = math.log(2.0 / self.points_per_unit)
        self.log_length_encoder = nn.Parameter(torch.tensor(init_log_length))
        self.log_length_decoder = nn.Parameter(torch.tensor(init_log_length))
        conv = nn.Conv1d if c.dim_x == 1 else nn.Conv2d
        self.grid_in = conv(1 + c.dim_y, c.d_model, 1)   # pointwise: [density, normalised y] → channels
        self.cnn = UNet(c.dim_x, c.d_model, c.num_layers, kernel_size)
        self.head = GaussianHead(c.d_model, c.ff_dim, c.dim_y)

    def options(self) -> dict:
        """``points_per_unit``, ``margin`` and ``kernel_size``."""
        return {"points_per_unit": self.points_per_unit, "margin": self.margin, "kernel_size": self.kernel_size}

    def embed_pairs(self, x: Tensor, y: Optional[Tensor]) -> Tensor:
        raise TypeError("ConvNP has no [x, y] embedding: it sees inputs only relative to its grid")

    def grid_axes(self, xc: Tensor, xt: Tensor) -> List[Tensor]:
        """Per input dimension, the grid coordinates ``[B, G_d]`` of each task (see the class docstring)."""
        x = torch.cat([xc, xt], 1)
        if not torch.isfinite(x).all():
            raise ValueError("ConvNP: xc and xt must be finite to lay the grid over them")
        low, high = x.amin(1) - self.margin, x.amax(1) + self.margin          # [B, dim_x]
        # Extents are differences, so they (and the grid sizes) do not change when the data shift.
        sizes = [int(math.ceil(float(e) * self.points_per_unit)) + 1 for e in (high - low).amax(0)]
        if math.prod(sizes) > MAX_GRID_POINTS:
            raise ValueError(f"ConvNP: the inputs span {[round(float(e), 3) for e in (high - low).amax(0)]} "
                             f"(with margin), a grid of {sizes} points at points_per_unit={self.points_per_unit}, "
                             f"more than {MAX_GRID_POINTS}; rescale x or lower points_per_unit")
        step = 1.0 / self.points_per_unit
        return [low[:, d:d + 1] + step * torch.arange(n, dtype=x.dtype, device=x.device)
                for d, n in enumerate(sizes)]

    def predict(self, xc: Tensor, yc: Tensor, xt: Tensor) -> Normal:
        """Predictive ``Normal`` over ``yt``, mean and scale ``[B, N_t, dim_y]``."""
        check_points(self, xc=xc, yc=yc, xt=xt)
        axes = self.grid_axes(xc, xt)
        values = torch.cat([torch.ones_like(yc[..., :1]), yc], -1)
        grid = points_to_grid(xc, values, axes, self.log_length_encoder.exp())
        density = grid[:, :1]
        # Gordon et al.'s normalisation: a weighted mean of y where there is data, bounded by max |y|.
        h = self.grid_in(torch.cat([density, grid[:, 1:] / (density + 1e-8)], 1))
        h = self.cnn(h)
        return self.head(grid_to_points(h, axes, xt, self.log_length_decoder.exp()))
