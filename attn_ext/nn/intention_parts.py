"""Learned parts of the paper-form :class:`~attn_ext.nn.Intention`: MLP embeddings (``e_Q``, ``e_K``,
``e_V``), the per-head ``e_w`` that transforms the fitted map, and the ridge ``α`` computed from the context.

Examples
--------
>>> import torch
>>> from attn_ext.nn.intention_parts import HeadwiseMLP, mlp
>>> mlp(8, 16, 4, depth=2)(torch.randn(3, 8)).shape
torch.Size([3, 4])
>>> HeadwiseMLP(num_heads=2, in_dim=4, hidden_dim=8, out_dim=4, depth=2)(torch.randn(5, 2, 4, 4)).shape
torch.Size([5, 2, 4, 4])
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def mlp(in_dim: int, hidden_dim: int, out_dim: int, depth: int) -> nn.Sequential:
    """``depth`` Linear layers with ReLU between them (``depth=1``: one Linear layer, no nonlinearity)."""
    if depth < 1:
        raise ValueError(f"mlp: depth must be >= 1, got {depth}")
    dims = [in_dim] + [hidden_dim] * (depth - 1) + [out_dim]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        layers.append(nn.Linear(a, b))
        if i < depth - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class HeadwiseMLP(nn.Module):
    """An MLP with its own weights for every head, applied to the last dimension of ``x [B, H, R, in_dim]``.

    Intention's ``e_w`` is this MLP applied to every row of a head's fitted map ``w [B, H, D, Dv]``:
    row ``i`` holds how key feature ``i`` maps onto the value features, and ``e_w`` transforms it in
    value space, so that ``E_Q · e_w(w)`` stays a prediction read at the queries. Weights are per
    head because the paper's heads have independent embeddings.

    Parameters
    ----------
    num_heads, in_dim, hidden_dim, out_dim : int
    depth : int
        Number of (per-head) linear layers, ReLU between them.
    """

    def __init__(self, num_heads: int, in_dim: int, hidden_dim: int, out_dim: int, depth: int) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"HeadwiseMLP: depth must be >= 1, got {depth}")
        dims = [in_dim] + [hidden_dim] * (depth - 1) + [out_dim]
        self.weights, self.biases = nn.ParameterList(), nn.ParameterList()
        for a, b in zip(dims[:-1], dims[1:]):
            bound = 1.0 / math.sqrt(a)  # nn.Linear's default initialisation, per head
            self.weights.append(nn.Parameter(torch.empty(num_heads, a, b).uniform_(-bound, bound)))
            self.biases.append(nn.Parameter(torch.empty(num_heads, b).uniform_(-bound, bound)))

    def forward(self, x: Tensor) -> Tensor:
        last = len(self.weights) - 1
        for i, (weight, bias) in enumerate(zip(self.weights, self.biases)):
            x = x @ weight + bias[:, None, :]  # [B, H, R, a] @ [H, a, b] -> [B, H, R, b]
            if i < last:
                x = F.relu(x)
        return x


class ContextRidge(nn.Module):
    """The ridge ``α [B, H]`` of each head computed from its embedded context.

    ``α = softplus(raw_h + g(φ))``: ``raw_h`` is the head's learned (or fixed) base, ``g`` a small
    MLP shared by the heads whose last layer starts at zero (so training starts from ``α = softplus(raw_h)``),
    and ``φ`` the head's context features

    - ``diag(ÊKᵀÊK) / n``: the mean square of every key feature over the ``n`` valid keys,
    - ``diag(ÊKᵀÊV) / n``: the mean product of key feature ``i`` with value feature ``i``,
    - ``log(1 + n)``.

    They are sums over the keys, so ``α`` does not depend on the keys' order and padding keys are
    left out; and they are read off the diagonals of the statistics ``KᵀK`` and ``KᵀV``, so the
    streaming path (condition / update / remove / query) gives the same ``α`` as one forward call.
    """

    def __init__(self, head_dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2 * head_dim + 1, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 1))
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, raw: Tensor, key_squares: Tensor, key_values: Tensor, count: Tensor) -> Tensor:
        """``raw [H]``; sums over the valid keys ``key_squares``, ``key_values [B, H, D]``; ``count [B, H]``.
        Returns ``α [B, H]``."""
        n = count.to(key_squares.dtype)
        mean = n.clamp_min(1.0)[..., None]  # no valid key: the sums are 0, and so the features
        features = torch.cat([key_squares / mean, key_values / mean, torch.log1p(n)[..., None]], -1)
        return F.softplus(raw.to(features.dtype) + self.net(features).squeeze(-1))

    @staticmethod
    def sums_over_keys(k: Tensor, v: Tensor, key_padding_mask) -> tuple[Tensor, Tensor, Tensor]:
        """``Σ k²``, ``Σ k·v`` per feature and the count, over the valid keys of ``k, v [B, H, N, D]``."""
        B, H, N, _ = k.shape
        if key_padding_mask is None:
            return (k * k).sum(2), (k * v).sum(2), torch.full((B, H), N, device=k.device, dtype=torch.long)
        valid = ~key_padding_mask[:, None, :, None]
        zero = k.new_zeros(())
        # where, not a product with the mask: padding keys may hold NaN/inf and must never be read
        squares = torch.where(valid, k * k, zero).sum(2)
        products = torch.where(valid, k * v, zero).sum(2)
        return squares, products, (~key_padding_mask).sum(1, keepdim=True).expand(B, H)
