"""``TEMultiheadAttention``: the translation-equivariant attention of TE-TNP (Ashman et al. 2024).

Tokens carry features ``z`` and fixed inputs ``x``. Per head ``h`` the logit of query ``i`` for key
``j`` is ``ρ(s_ij, x_i − x_j)_h``, where ``s_ij = (q_i·k_j / √d_head)`` over all heads and ``ρ`` is
an MLP; the output is ``Σ_j softmax_j(logits) v_j``. The logits depend on the inputs only through
their differences, so shifting every ``x`` by one vector leaves the output unchanged.

Every call runs the fused op :func:`attn_ext.te_attention` (the MLP per tile of (query, key) pairs with an online
softmax, recomputed in the backward): memory independent of ``M·N`` in training and inference alike, where the
plain formula forms the ``[B, M, N, kernel_hidden]`` hidden layer. ``return_weights`` alone still forms the dense
logits (it returns an ``[B, M, N]`` tensor anyway). The parameters and state dict are the plain formula's:
``to_q``, ``to_k``, ``to_v``, ``to_out`` and ``kernel`` (``nn.Sequential(Linear, ReLU, Linear)``), whose linear
layers the op takes as its ``w1, b1, w2, b2``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn
from attn_ext.ops.te_attention import te_attention
from attn_ext.ops.te_attention.naive import pair_features


class TEMultiheadAttention(nn.Module):
    """Multi-head attention with logits ``ρ(q_iᵀk_j per head, x_i − x_j)``.

    Parameters
    ----------
    dim : int
        Width of the token features (queries, keys, values and output).
    num_heads : int
        Heads; must divide ``dim`` (head width ``dim // num_heads``).
    dim_x : int
        Width of the inputs ``x`` whose pairwise differences enter the logits.
    kernel_hidden : int, optional
        Hidden width of ``ρ = Linear(num_heads + dim_x, kernel_hidden) → ReLU → Linear(·, num_heads)``;
        default ``dim``.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.nn.te_attention import TEMultiheadAttention
    >>> attn = TEMultiheadAttention(dim=16, num_heads=2, dim_x=1)
    >>> zq, zk, xq, xk = torch.randn(3, 5, 16), torch.randn(3, 8, 16), torch.randn(3, 5, 1), torch.randn(3, 8, 1)
    >>> out = attn(zq, zk, xq, xk)
    >>> out.shape, torch.allclose(out, attn(zq, zk, xq + 2.5, xk + 2.5), atol=1e-5)
    (torch.Size([3, 5, 16]), True)
    """

    def __init__(self, dim: int, num_heads: int, dim_x: int, kernel_hidden: Optional[int] = None) -> None:
        super().__init__()
        if num_heads < 1 or dim % num_heads:
            raise ValueError(f"TEMultiheadAttention: num_heads={num_heads} must divide dim={dim}")
        if dim_x < 1:
            raise ValueError(f"TEMultiheadAttention: dim_x must be >= 1, got {dim_x}")
        self.dim, self.num_heads, self.dim_x = dim, num_heads, dim_x
        self.head_dim = dim // num_heads
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)
        self.to_out = nn.Linear(dim, dim)
        hidden = dim if kernel_hidden is None else kernel_hidden
        self.kernel = nn.Sequential(nn.Linear(num_heads + dim_x, hidden), nn.ReLU(), nn.Linear(hidden, num_heads))

    def _check(self, zq: Tensor, zk: Tensor, xq: Tensor, xk: Tensor, zv: Tensor) -> None:
        shapes = dict(zq=zq, zk=zk, zv=zv, xq=xq, xk=xk)
        desc = ", ".join(f"{k} {tuple(v.shape)}" for k, v in shapes.items())
        ok = all(t.dim() == 3 for t in shapes.values())
        ok = ok and zq.shape[-1] == zk.shape[-1] == zv.shape[-1] == self.dim
        ok = ok and xq.shape[-1] == xk.shape[-1] == self.dim_x
        ok = ok and len({t.shape[0] for t in shapes.values()}) == 1
        ok = ok and zq.shape[1] == xq.shape[1] and zk.shape[1] == zv.shape[1] == xk.shape[1]
        if not ok:
            raise ValueError(f"TEMultiheadAttention(dim={self.dim}, dim_x={self.dim_x}): expected zq [B, M, "
                             f"{self.dim}], zk/zv [B, N, {self.dim}], xq [B, M, {self.dim_x}], xk [B, N, "
                             f"{self.dim_x}], got {desc}")

    def forward(self, zq: Tensor, zk: Tensor, xq: Tensor, xk: Tensor, zv: Optional[Tensor] = None,
                return_weights: bool = False, return_mean_inputs: bool = False):
        """Output ``[B, M, dim]`` for queries ``(zq [B, M, dim], xq [B, M, dim_x])`` over keys
        ``(zk [B, N, dim], xk [B, N, dim_x])``; values from ``zv`` (default ``zk``). ``return_weights``: also the
        attention weights averaged over the heads, ``[B, M, N]`` (each row sums to 1), as ``(out, weights)``.
        ``return_mean_inputs``: also ``Σ_j w_ij xk_j`` with those weights, ``[B, M, dim_x]`` (what a query's attention
        makes of the key inputs, without forming the weights: the inputs ride along as extra value columns), as
        ``(out, mean)``."""
        if return_weights and return_mean_inputs:
            raise ValueError("TEMultiheadAttention: ask for return_weights or return_mean_inputs, not both")
        zv = zk if zv is None else zv
        self._check(zq, zk, xq, xk, zv)
        b, m, n, h = zq.shape[0], zq.shape[1], zk.shape[1], self.num_heads
        q = self.to_q(zq).view(b, m, h, self.head_dim)
        k = self.to_k(zk).view(b, n, h, self.head_dim)
        v = self.to_v(zv).view(b, n, h, self.head_dim)
        if not return_weights:
            first, second = self.kernel[0], self.kernel[2]
            values = v.transpose(1, 2)
            if return_mean_inputs:  # the key inputs as extra value columns of every head
                values = torch.cat([values, xk[:, None].expand(b, h, n, self.dim_x).to(values.dtype)], -1)
            out = te_attention(q.transpose(1, 2), k.transpose(1, 2), values, xq, xk, first.weight, first.bias,
                               second.weight, second.bias, scale=self.head_dim ** -0.5, activation="relu")
            result = self.to_out(out[..., :self.head_dim].transpose(1, 2).reshape(b, m, self.dim))
            return (result, out[..., self.head_dim:].mean(1)) if return_mean_inputs else result
        features = pair_features(q.transpose(1, 2), k.transpose(1, 2), xq, xk, self.head_dim ** -0.5)
        logits = self.kernel(features)                                           # [B, M, N, H]
        weights = torch.softmax(logits, dim=2)
        out = self.to_out(torch.einsum("bmnh,bnhd->bmhd", weights, v).reshape(b, m, self.dim))
        return out, weights.mean(-1)
