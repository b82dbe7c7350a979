"""Intention modules (Garnelo & Czarnecki, docs/spec.md §4): ``Intention``, ``InformerLayer``, ``Informer``."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attn_ext.ops.intention as intention_ops
from attn_ext.ops.intention import IntentionState


def _inverse_softplus(y: float) -> float:
    return y + math.log(-math.expm1(-y))


class Intention(nn.Module):
    """Multi-head (σ)Intention: ``e_w[Q̂ (K̂ᵀK̂ + αI)⁻¹ K̂ᵀV̂]`` with ``Q̂ = e_Q(query)`` etc., per head.

    The keys and values enter only through the per-head statistics ``K̂ᵀK̂`` and ``K̂ᵀV̂``, so the
    module conditions on a context in memory independent of its size and supports exact updates,
    merges and removals (:meth:`condition`, :meth:`update`, :meth:`remove`, :meth:`query`).

    Parameters
    ----------
    dim : int
        Model width (queries and output); split into ``num_heads`` heads.
    num_heads : int
    alpha_init : float
        Initial ridge ``α > 0`` (the same for every head).
    learn_alpha : bool
        Learn one ``α`` per head, parameterised as ``softplus(raw)`` so that it stays positive;
        otherwise ``α`` is a fixed buffer.
    sigma : bool
        σIntention: ``softmax(Q̂ (K̂ᵀK̂ + αI)⁻¹ K̂ᵀ) V̂`` (then :meth:`condition` and friends are not
        available: the softmax needs the keys).
    kdim, vdim : int, optional
        Widths of the keys and values (default ``dim``).
    query_scale : float
        Multiplies the queries (default 1; the paper's App. 9 suggests ``sqrt(head_dim)`` in deep stacks).
    backend : str, optional
        Kernel backend, as for :func:`attn_ext.intention`.

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> layer = ae.nn.Intention(32, 4)
    >>> x, ctx = torch.randn(2, 5, 32), torch.randn(2, 100, 32)
    >>> out = layer(x, ctx, ctx)
    >>> state = layer.update(layer.condition(ctx[:, :60], ctx[:, :60]), ctx[:, 60:], ctx[:, 60:])
    >>> bool(torch.allclose(layer.query(x, state), out, atol=1e-4))
    True
    """

    def __init__(self, dim: int, num_heads: int, alpha_init: float = 1.0, learn_alpha: bool = True,
                 sigma: bool = False, kdim: Optional[int] = None, vdim: Optional[int] = None,
                 query_scale: float = 1.0, backend: Optional[str] = None) -> None:
        super().__init__()
        if dim <= 0 or num_heads <= 0 or dim % num_heads:
            raise ValueError(f"dim={dim} must be a positive multiple of num_heads={num_heads}")
        if not (math.isfinite(alpha_init) and alpha_init > 0):
            raise ValueError(f"alpha_init must be a finite float > 0, got {alpha_init!r}")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.sigma, self.query_scale, self.backend = sigma, float(query_scale), backend
        self.e_q = nn.Linear(dim, dim)
        self.e_k = nn.Linear(kdim or dim, dim)
        self.e_v = nn.Linear(vdim or dim, dim)
        self.e_w = nn.Linear(dim, dim)
        raw = torch.full((num_heads,), _inverse_softplus(float(alpha_init)))
        if learn_alpha:
            self.raw_alpha = nn.Parameter(raw)
        else:
            self.register_buffer("raw_alpha", raw)

    @property
    def alpha(self) -> Tensor:
        """``[num_heads]`` ridge per head (positive)."""
        return F.softplus(self.raw_alpha)

    def _heads(self, x: Tensor) -> Tensor:
        B, L, _ = x.shape
        return x.view(B, L, self.num_heads, self.head_dim).transpose(1, 2)

    def _merge(self, x: Tensor) -> Tensor:
        B, H, L, Dh = x.shape
        return self.e_w(x.transpose(1, 2).reshape(B, L, H * Dh))

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        """``[B, M, dim]`` from ``query [B, M, dim]``, ``key [B, N, kdim]``, ``value [B, N, vdim]``."""
        q, k, v = self._heads(self.e_q(query)), self._heads(self.e_k(key)), self._heads(self.e_v(value))
        fn = intention_ops.sigma_intention if self.sigma else intention_ops.intention
        out = fn(q, k, v, alpha=self.alpha.to(q.dtype), key_padding_mask=key_padding_mask, scale=self.query_scale,
                 backend=self.backend)
        return self._merge(out)

    def condition(self, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None) -> IntentionState:
        """Per-head statistics of a context (or of a first chunk of it)."""
        self._no_sigma("condition")
        return intention_ops.intention_state(self._heads(self.e_k(key)), self._heads(self.e_v(value)),
                                     key_padding_mask=key_padding_mask)

    def update(self, state: IntentionState, key: Tensor, value: Tensor,
               key_padding_mask: Optional[Tensor] = None) -> IntentionState:
        """``state`` with new context points added: cost independent of the points seen before."""
        return intention_ops.merge_intention_states(state, self.condition(key, value, key_padding_mask))

    def remove(self, state: IntentionState, key: Tensor, value: Tensor,
               key_padding_mask: Optional[Tensor] = None) -> IntentionState:
        """``state`` with context points that were added before taken out again."""
        self._no_sigma("remove")
        return intention_ops.remove_from_intention_state(state, self._heads(self.e_k(key)), self._heads(self.e_v(value)),
                                                 key_padding_mask=key_padding_mask)

    def query(self, query: Tensor, state: IntentionState) -> Tensor:
        """The module's output for ``query`` against the context summarised by ``state``."""
        self._no_sigma("query")
        q = self._heads(self.e_q(query))
        out = intention_ops.intention_from_state(q, state, alpha=self.alpha.to(state.gram.dtype), scale=self.query_scale)
        return self._merge(out)

    def _no_sigma(self, what: str) -> None:
        if self.sigma:
            raise RuntimeError(f"Intention(sigma=True).{what}: σIntention needs the keys themselves, not statistics")


class InformerLayer(nn.Module):
    """Pre-norm residual block: self-(σ)Intention, then an MLP (the paper's Informer layer).

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> ae.nn.InformerLayer(32, 4)(torch.randn(2, 10, 32)).shape
    torch.Size([2, 10, 32])
    """

    def __init__(self, dim: int, num_heads: int, hidden_dim: Optional[int] = None, **intention_kwargs) -> None:
        super().__init__()
        self.norm_attention, self.norm_mlp = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.intention = Intention(dim, num_heads, **intention_kwargs)
        hidden = hidden_dim or 2 * dim
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))

    def forward(self, x: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        h = self.norm_attention(x)
        x = x + self.intention(h, h, h, key_padding_mask)
        return x + self.mlp(self.norm_mlp(x))


class Informer(nn.Module):
    """A stack of :class:`InformerLayer` with a final LayerNorm.

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> ae.nn.Informer(2, 32, 4)(torch.randn(2, 10, 32)).shape
    torch.Size([2, 10, 32])
    """

    def __init__(self, num_layers: int, dim: int, num_heads: int, hidden_dim: Optional[int] = None,
                 **intention_kwargs) -> None:
        super().__init__()
        if num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {num_layers}")
        self.layers = nn.ModuleList(InformerLayer(dim, num_heads, hidden_dim, **intention_kwargs)
                                    for _ in range(num_layers))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        for layer in self.layers:
            x = layer(x, key_padding_mask)
        return self.norm(x)
