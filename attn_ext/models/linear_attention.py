"""Linear attention with the feature map ``φ(x) = elu(x) + 1`` (Katharopoulos et al.; the chapter's LinearTNP).

attn_ext has no linear-attention kernel, and none is needed: the context enters only through the
per-head statistics ``φ(K)ᵀV`` (``D × Dv``) and ``Σ φ(K)`` (``D``), a few small matmuls whose memory
is independent of the number of keys beyond the projected keys themselves.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class LinearAttention(nn.Module):
    """Multi-head ``φ(Q)(φ(K)ᵀV) / (φ(Q)·Σφ(K))`` with input and output projections.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.models.linear_attention import LinearAttention
    >>> LinearAttention(32, 4)(torch.randn(2, 5, 32), torch.randn(2, 50, 32), torch.randn(2, 50, 32)).shape
    torch.Size([2, 5, 32])
    """

    def __init__(self, dim: int, num_heads: int, eps: float = 1e-6) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim={dim} must be divisible by num_heads={num_heads}")
        self.num_heads, self.eps = num_heads, eps
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def _heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)

    def forward(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        if query.dim() != 3 or key.dim() != 3 or key.shape[:2] != value.shape[:2]:
            raise ValueError(f"LinearAttention: query [B, M, E], key and value [B, N, E] expected, got "
                             f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        q = F.elu(self._heads(self.q_proj(query))) + 1
        k = F.elu(self._heads(self.k_proj(key))) + 1
        v = self._heads(self.v_proj(value))
        kv = k.transpose(-1, -2) @ v                                      # [B, H, D, Dv]
        normaliser = q @ k.sum(dim=-2, keepdim=True).transpose(-1, -2)    # [B, H, M, 1]
        out = (q @ kv) / (normaliser + self.eps)
        return self.out_proj(out.transpose(1, 2).flatten(2))
