"""Data and models of the least-squares scaling experiment (the Intention paper's Figure 3, its Appendix 2).

A task is ``N = 10`` noiseless observations of one random linear map: ``W ~ N(0, I_d)``,
``x_i ~ N(0, I_d)``, ``y_i = x_i W``. Every model reads the ten ``[x_i; y_i]`` pairs and predicts
``W`` itself (``[d]``); the loss is the mean squared error against the true ``W``. Since
``E[W_j²] = 1``, that error is already relative: predicting 0 scores 1.

The models, with one *latent size* ``s`` for all their layers (the paper's appendix):

- ``intention``: ``E_K = e_K([x; y])``, ``E_V = e_V([x; y])`` (two-layer ReLU MLPs, width ``s``), the
  fitted ridge map ``w = (E_KᵀE_K + αI)⁻¹ E_KᵀE_V`` (``[s, s]``, :func:`attn_ext.intention` read at the
  identity queries: the paper sets ``E_Q = 0`` and outputs the map), ``Ŵ = e_P(w)`` (two-layer MLP);
  ``α = softplus(·)`` learned.
- ``attention``: one-layer embeddings, leaky ReLU (slope 0.01), multi-head softmax self-attention
  (:func:`attn_ext.cross_attention`) over the ten points, leaky ReLU, mean over the points, a linear
  decoder; ``heads`` heads of width ``s`` each (the paper: 5 heads).
- ``linear_attention``: the same with the softmax removed, ``Q (KᵀV) / N`` (the ``α → ∞`` limit of
  Intention; plain PyTorch, no op of ours computes it).
- ``np``: ``e_H([x; y])`` (two-layer MLP), mean over the points, ``e_P`` (four-layer MLP).
- ``mlp``: a four-layer MLP of the flattened ten pairs.

Examples
--------
>>> import torch
>>> x, y, w = least_squares_batch(4, 3, generator=torch.Generator().manual_seed(0))
>>> x.shape, y.shape, w.shape
(torch.Size([4, 10, 3]), torch.Size([4, 10, 1]), torch.Size([4, 3]))
>>> build_regressor("intention", dim=3, latent=4)(x, y).shape
torch.Size([4, 3])
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attn_ext as ae
from attn_ext.nn.intention_parts import mlp

#: Observations per task (the paper's 10 pairs).
NUM_POINTS = 10
#: Leaky-ReLU slope of the paper's attention model.
LEAKY_SLOPE = 0.01
#: Heads of the attention models (the paper's multi-head attention has 5).
ATTENTION_HEADS = 5
#: Initial ridge of the Intention model: small, since the data are noiseless.
INTENTION_ALPHA_INIT = 0.1


def least_squares_batch(batch: int, dim: int, num_points: int = NUM_POINTS,
                        generator: Optional[torch.Generator] = None) -> tuple[Tensor, Tensor, Tensor]:
    """``batch`` tasks of the paper's Appendix 2: ``x [B, N, d]``, ``y = x W [B, N, 1]``, ``W [B, d]``."""
    if batch < 1 or dim < 1 or num_points < 1:
        raise ValueError(f"least_squares_batch: batch, dim and num_points must be >= 1, got {batch}, {dim}, "
                         f"{num_points}")
    w = torch.randn(batch, dim, generator=generator)
    x = torch.randn(batch, num_points, dim, generator=generator)
    return x, x @ w.unsqueeze(-1), w


def _check(name: str, dim: int, x: Tensor, y: Tensor) -> None:
    if x.dim() != 3 or x.shape[-1] != dim or y.shape != (*x.shape[:2], 1):
        raise ValueError(f"{name}: expected x [B, N, {dim}] and y [B, N, 1], got x {tuple(x.shape)} and "
                         f"y {tuple(y.shape)}")


class IntentionRegressor(nn.Module):
    """Ridge map of embedded keys and values, decoded into ``Ŵ`` (see the module docstring)."""

    def __init__(self, dim: int, latent: int) -> None:
        super().__init__()
        self.dim, self.latent = dim, latent
        self.e_k = mlp(dim + 1, latent, latent, 2)
        self.e_v = mlp(dim + 1, latent, latent, 2)
        self.e_p = mlp(latent * latent, latent, dim, 2)
        self.raw_alpha = nn.Parameter(torch.tensor(math.log(math.expm1(INTENTION_ALPHA_INIT))))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        _check(type(self).__name__, self.dim, x, y)
        xy = torch.cat([x, y], -1)
        k, v = self.e_k(xy).unsqueeze(1), self.e_v(xy).unsqueeze(1)              # [B, 1, N, s]
        # The identity queries read the whole map w = (KᵀK + αI)⁻¹KᵀV, one row per key feature.
        eye = torch.eye(self.latent, dtype=x.dtype).expand(x.shape[0], 1, -1, -1)
        w = ae.intention(eye, k, v, alpha=F.softplus(self.raw_alpha))            # [B, 1, s, s]
        return self.e_p(w.flatten(1))


class AttentionRegressor(nn.Module):
    """The paper's attention model; ``softmax=False`` gives linear attention ``Q (KᵀV) / N``."""

    def __init__(self, dim: int, latent: int, softmax: bool = True, heads: int = ATTENTION_HEADS) -> None:
        super().__init__()
        self.dim, self.latent, self.heads, self.softmax = dim, latent, heads, softmax
        width = heads * latent
        self.e_q, self.e_k, self.e_v = (nn.Linear(dim + 1, width) for _ in range(3))
        self.e_p = nn.Linear(width, dim)

    def _heads(self, t: Tensor) -> Tensor:
        return F.leaky_relu(t, LEAKY_SLOPE).unflatten(-1, (self.heads, self.latent)).transpose(1, 2)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        _check(type(self).__name__, self.dim, x, y)
        xy = torch.cat([x, y], -1)
        q, k, v = self._heads(self.e_q(xy)), self._heads(self.e_k(xy)), self._heads(self.e_v(xy))
        if self.softmax:
            h = ae.cross_attention(q, k, v)
        else:
            # Divided by N so that the output's scale does not grow with the number of points.
            h = q @ (k.transpose(-1, -2) @ v) / x.shape[1]
        h = F.leaky_relu(h.transpose(1, 2).flatten(2), LEAKY_SLOPE)                # [B, N, heads·s]
        return self.e_p(h.mean(1))


class NPRegressor(nn.Module):
    """Neural-process style: mean of per-point embeddings, then a four-layer decoder."""

    def __init__(self, dim: int, latent: int) -> None:
        super().__init__()
        self.dim = dim
        self.e_h = mlp(dim + 1, latent, latent, 2)
        self.e_p = mlp(latent, latent, dim, 4)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        _check(type(self).__name__, self.dim, x, y)
        return self.e_p(self.e_h(torch.cat([x, y], -1)).mean(1))


class MLPRegressor(nn.Module):
    """A four-layer MLP of the flattened pairs (needs exactly ``num_points`` of them)."""

    def __init__(self, dim: int, latent: int, num_points: int = NUM_POINTS) -> None:
        super().__init__()
        self.dim, self.num_points = dim, num_points
        self.e_p = mlp(num_points * (dim + 1), latent, dim, 4)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        _check(type(self).__name__, self.dim, x, y)
        if x.shape[1] != self.num_points:
            raise ValueError(f"MLPRegressor: built for {self.num_points} points, got x {tuple(x.shape)}")
        return self.e_p(torch.cat([x, y], -1).flatten(1))


#: Model name -> constructor ``(dim, latent) -> nn.Module``, in the report's column order.
REGRESSORS = {
    "intention": IntentionRegressor,
    "attention": AttentionRegressor,
    "linear_attention": lambda dim, latent: AttentionRegressor(dim, latent, softmax=False),
    "np": NPRegressor,
    "mlp": MLPRegressor,
}


def build_regressor(name: str, dim: int, latent: int) -> nn.Module:
    """One of :data:`REGRESSORS` for ``d = dim`` and latent size ``s = latent``."""
    if name not in REGRESSORS:
        raise ValueError(f"unknown least-squares model {name!r}; choose from {', '.join(REGRESSORS)}")
    if dim < 1 or latent < 1:
        raise ValueError(f"{name}: dim and latent must be >= 1, got {dim} and {latent}")
    return REGRESSORS[name](dim, latent)


def train_regressor(model: nn.Module, dim: int, *, steps: int, batch: int, lr: float, eval_set: tuple,
                    generator: torch.Generator) -> dict:
    """Adam on fresh tasks every step; returns the first and last training losses and the final eval MSE."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    first = last = float("nan")
    for step in range(steps):
        x, y, w = least_squares_batch(batch, dim, generator=generator)
        loss = F.mse_loss(model(x, y), w)
        opt.zero_grad()
        loss.backward()
        opt.step()
        last = loss.item()
        if step == 0:
            first = last
    return {"first_loss": first, "last_loss": last, "eval_mse": evaluate(model, eval_set)}


@torch.no_grad()
def evaluate(model: nn.Module, eval_set: tuple) -> float:
    """Mean squared error of ``Ŵ`` over a fixed set of tasks (1 = predicting zero)."""
    x, y, w = eval_set
    return float(F.mse_loss(model(x, y), w))
