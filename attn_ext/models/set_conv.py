"""Set convolutions of ConvNP: points onto a uniform grid and back, with an RBF weight.

A set convolution (Gordon et al. 2020, "Convolutional Conditional Neural Processes") evaluates
``h(g) = Σ_n ψ(g − x_n) v_n`` at the grid points ``g`` (encoder) or ``z(x) = Σ_g ψ(x − g) h(g)`` at
the points ``x`` (decoder), with ``ψ(d) = exp(−|d|² / (2ℓ²))``. On a 2-D grid the RBF factorises,
``ψ(d) = ψ₁(d₁)·ψ₂(d₂)``, so both directions are computed from the per-axis weights ``[B, N, G_d]``
with two contractions and no ``[N, G₁·G₂]`` matrix is ever formed: memory grows with the grid and
with ``N·(G₁ + G₂)``, not with ``N·G₁·G₂`` (the set convolutions of the chapter's ConvNP form that
matrix, which is why its memory column grows with ``N_c`` and ``N_t``).

>>> import torch
>>> x, v = torch.tensor([[[0.0]]]), torch.ones(1, 1, 1)
>>> axes = [torch.tensor([[-1.0, 0.0, 1.0]])]
>>> points_to_grid(x, v, axes, torch.tensor(1.0))
tensor([[[0.6065, 1.0000, 0.6065]]])
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def axis_weights(x: Tensor, axis: Tensor, length: Tensor) -> Tensor:
    """``ψ_d(x_n − g_k) = exp(−(x_n − g_k)² / (2ℓ²))`` as ``[B, N, G]`` from ``x [B, N]``, ``axis [B, G]``."""
    return torch.exp(-0.5 * ((x.unsqueeze(-1) - axis.unsqueeze(-2)) / length) ** 2)


def points_to_grid(x: Tensor, values: Tensor, axes: Sequence[Tensor], length: Tensor) -> Tensor:
    """``h(g) = Σ_n ψ(g − x_n) v_n`` on the grid spanned by ``axes``.

    Parameters
    ----------
    x : Tensor
        ``[B, N, dim_x]`` point locations, ``dim_x`` = ``len(axes)`` (1 or 2).
    values : Tensor
        ``[B, N, C]`` values carried by the points.
    axes : sequence of Tensor
        Per input dimension, the grid coordinates ``[B, G_d]`` (a grid of its own per task).
    length : Tensor
        RBF length scale, a scalar tensor.

    Returns
    -------
    Tensor
        ``[B, C, G_1]`` or ``[B, C, G_1, G_2]``, channel first as ``Conv1d``/``Conv2d`` take it.
    """
    b, _, c = values.shape
    w1 = axis_weights(x[..., 0], axes[0], length)                       # [B, N, G1]
    if len(axes) == 1:
        return values.transpose(1, 2) @ w1                              # [B, C, G1]
    w2 = axis_weights(x[..., 1], axes[1], length)                       # [B, N, G2]
    g1, g2 = w1.shape[-1], w2.shape[-1]
    # Σ_n w1[n,i]·w2[n,j]·v[n,c]: fold (i, c) into one matmul dimension so the product never holds
    # an [N, G1, G2] tensor; the intermediate is [N, G1·C] (C is small: density and y channels).
    weighted = (w1.unsqueeze(-1) * values.unsqueeze(-2)).reshape(b, -1, g1 * c)   # [B, N, G1·C]
    grid = weighted.transpose(1, 2) @ w2                                # [B, G1·C, G2]
    return grid.reshape(b, g1, c, g2).transpose(1, 2)                   # [B, C, G1, G2]


def grid_to_points(h: Tensor, axes: Sequence[Tensor], x: Tensor, length: Tensor) -> Tensor:
    """``z(x_m) = Σ_g ψ(x_m − g) h(g)`` at ``x [B, M, dim_x]`` from ``h [B, C, G_1(, G_2)]``; ``[B, M, C]``."""
    w1 = axis_weights(x[..., 0], axes[0], length)                       # [B, M, G1]
    if len(axes) == 1:
        return w1 @ h.transpose(1, 2)                                   # [B, M, C]
    w2 = axis_weights(x[..., 1], axes[1], length)                       # [B, M, G2]
    b, c, g1, g2 = h.shape
    # Contract the second axis first ([B, C·G1, M]), then the first one point by point: the largest
    # intermediate is C·G1·M, never M·G1·G2.
    partial = (h.reshape(b, c * g1, g2) @ w2.transpose(1, 2)).reshape(b, c, g1, -1)   # [B, C, G1, M]
    return torch.einsum("bcim,bmi->bmc", partial, w1)
