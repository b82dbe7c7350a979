"""``HyperMixer``: HyperMixer's token mixing (Mai et al. 2023), a linear-time alternative to cross attention.

A token-mixing MLP ``W_1 σ(W_2ᵀ X)`` whose weight matrices are not parameters but are generated,
one row per token, by two small hypernetworks. Because each token brings its own row, the layer
takes sets of any size, and because the tokens meet only through the ``p × d`` matrix
``σ(W_kᵀ V)``, time and memory are linear in the number of tokens: no ``[M, N]`` score matrix exists.
No op of attn_ext computes this (it is two batched matmuls around a GELU, which PyTorch's matmul
already does at full speed), so the layer is written in PyTorch.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attn_ext.nn.layer_norm import LayerNorm


class _HeadwiseMLP(nn.Module):
    """``num_heads`` independent two-layer MLPs, head ``h`` reading the ``h``-th slice of the features.

    ``[B, L, dim] → [B, num_heads, L, out_dim / num_heads]``: ``GELU(x_h A_h (+ a_h)) B_h (+ b_h)``.
    """

    def __init__(self, dim: int, hidden_dim: int, out_dim: int, num_heads: int, bias: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.fc1 = nn.Parameter(torch.empty(num_heads, dim // num_heads, hidden_dim // num_heads))
        self.fc2 = nn.Parameter(torch.empty(num_heads, hidden_dim // num_heads, out_dim // num_heads))
        # Xavier with the GELU/ReLU gain, per head (fan in and out of one head's matrix), as the
        # official HyperMixing code intends; its generated weights then start at unit-order scale.
        for weight in (self.fc1, self.fc2):
            for head in weight:
                nn.init.xavier_uniform_(head, gain=math.sqrt(2.0))
        self.bias1 = nn.Parameter(torch.zeros(num_heads, 1, hidden_dim // num_heads)) if bias else None
        self.bias2 = nn.Parameter(torch.zeros(num_heads, 1, out_dim // num_heads)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        heads = x.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)   # [B, H, L, dim / H]
        hidden = heads @ self.fc1
        if self.bias1 is not None:
            hidden = hidden + self.bias1
        out = F.gelu(hidden) @ self.fc2
        return out if self.bias2 is None else out + self.bias2


class HyperMixer(nn.Module):
    """Multi-head HyperMixer token mixing: ``H = W_q σ(W_kᵀ V)`` per head, σ = GELU.

    For queries ``Q [B, M, dim]`` and keys/values ``K, V [B, N, dim]`` (cross mixing), head ``h``
    computes

    - ``W_k = h_k(K) [N, p_h]`` and ``W_q = h_q(Q) [M, p_h]``: the hypernetworks applied row by row
      (``MLP : dim/H → hidden/H → p_h``, ``p_h = mixing_dim / H``);
    - ``S = σ(W_kᵀ V_h) [p_h, dim/H]``: the product **contracts the key index** ``j = 1..N``,
      ``S_{a,c} = σ(Σ_j (W_k)_{j,a} V_{j,c})``, summing every key/value token into ``p_h`` mixed
      features. The generated matrix that is contracted with ``V`` must have one row per value
      token, so it has to come from the keys;
    - ``H_h = W_q S [M, dim/H]``: each query's own row of ``W_q`` reads the mixed features out, so
      the result has the queries' length ``M`` and query ``i``'s output depends on ``q_i`` and on the
      keys/values only, never on the other queries.

    The heads' outputs are concatenated (``[B, M, dim]``) and, by default, layer-normalised.

    This is the chapter's equation 0.4.2, ``H = W_k σ(W_qᵀ V)``, with the two hypernetworks named by
    the set they read: the chapter writes it for self mixing (``Q = K = V = X``), where the names are
    interchangeable; for cross mixing only this assignment has consistent shapes, and it is the one
    of HyperMixer's token-mixing MLP ``W_1 σ(W_2ᵀ X)`` (``W_2`` from the mixed tokens, ``W_1`` from
    the outputs' tokens) and of the authors' code.

    Cost: ``O((M + N) · dim · (hidden + mixing_dim) / H)`` time, ``O((M + N) · (dim + mixing_dim))``
    memory, linear in both set sizes.

    Departures from the HyperMixer paper, both for sets: no position embeddings are added before
    the hypernetworks (an NP's tokens carry their inputs ``x`` in their features, and the layer must
    not depend on the order of the tokens), and there is no tied variant (queries and keys differ in
    cross mixing).

    Parameters
    ----------
    dim : int
        Width of queries, keys, values and output.
    mixing_dim : int
        ``p``, the generated weights' width over all heads (the token-mixing MLP's hidden size).
    num_heads : int
        Heads; must divide ``dim``, ``mixing_dim`` and ``hidden_dim``. Head ``h`` mixes the ``h``-th
        slice of the value features with hypernetworks that read the ``h``-th slice of the query and
        key features (the authors' multi-head HyperMixing).
    hidden_dim : int, optional
        Hidden width of the hypernetwork MLPs (default ``dim``, as the authors' code).
    bias : bool
        Biases in the hypernetwork MLPs (default False, as the authors' code).
    layer_norm : bool
        LayerNorm on the output (default True, as the authors' code; it keeps the output's scale
        from growing with ``N``, since ``W_kᵀ V`` is a sum over the keys). False: exactly eq. 0.4.2.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.nn import HyperMixer
    >>> mixer = HyperMixer(16, mixing_dim=32, num_heads=2)
    >>> q, kv = torch.randn(3, 5, 16), torch.randn(3, 40, 16)
    >>> mixer(q, kv, kv).shape
    torch.Size([3, 5, 16])
    >>> pad = torch.zeros(3, 40, dtype=torch.bool); pad[:, 30:] = True   # True = padding
    >>> bool(torch.allclose(mixer(q, kv, kv, key_padding_mask=pad), mixer(q, kv[:, :30], kv[:, :30]), atol=1e-5))
    True
    """

    def __init__(self, dim: int, mixing_dim: int, num_heads: int = 1, *, hidden_dim: Optional[int] = None,
                 bias: bool = False, layer_norm: bool = True) -> None:
        super().__init__()
        hidden_dim = dim if hidden_dim is None else hidden_dim
        sizes = {"dim": dim, "mixing_dim": mixing_dim, "hidden_dim": hidden_dim}
        if not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"HyperMixer: num_heads must be a positive int, got {num_heads!r}")
        for name, size in sizes.items():
            if not isinstance(size, int) or size < 1 or size % num_heads:
                raise ValueError(f"HyperMixer: {name}={size!r} must be a positive multiple of num_heads={num_heads}")
        self.dim, self.mixing_dim, self.num_heads, self.hidden_dim = dim, mixing_dim, num_heads, hidden_dim
        self.hyper_query = _HeadwiseMLP(dim, hidden_dim, mixing_dim, num_heads, bias)
        self.hyper_key = _HeadwiseMLP(dim, hidden_dim, mixing_dim, num_heads, bias)
        self.norm = LayerNorm(dim) if layer_norm else None

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, mixing_dim={self.mixing_dim}, num_heads={self.num_heads}, "
                f"hidden_dim={self.hidden_dim}")

    def _check(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor]) -> None:
        tensors = {"query": query, "key": key, "value": value}
        if not all(isinstance(t, Tensor) and t.dim() == 3 and t.shape[-1] == self.dim for t in tensors.values()):
            raise ValueError(f"HyperMixer: query [B, M, {self.dim}], key and value [B, N, {self.dim}] expected, got "
                             + ", ".join(f"{k} {tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}"
                                         for k, t in tensors.items()))
        if not (query.shape[0] == key.shape[0] == value.shape[0]) or key.shape[1] != value.shape[1]:
            raise ValueError(f"HyperMixer: query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                             f"{tuple(value.shape)} must share the batch size, key and value the length")
        if key_padding_mask is not None and (not isinstance(key_padding_mask, Tensor)
                                             or key_padding_mask.dtype != torch.bool
                                             or key_padding_mask.shape != key.shape[:2]):
            got = (f"{tuple(key_padding_mask.shape)} {key_padding_mask.dtype}" if isinstance(key_padding_mask, Tensor)
                   else type(key_padding_mask).__name__)
            raise ValueError(f"HyperMixer: key_padding_mask must be a bool tensor {tuple(key.shape[:2])} "
                             f"(True = padding), got {got}")

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        """``[B, M, dim]``: the mixed values read out at the queries.

        ``key_padding_mask [B, N]`` (bool, True = padding) removes keys from the sum over ``j``: a
        padded key's generated row and its value are replaced by zeros (``torch.where``, so NaN or
        infinite padding does not leak in). A row whose keys are all padding mixes an empty sum:
        ``S = σ(0) = 0`` and the output before the LayerNorm is zero.
        """
        self._check(query, key, value, key_padding_mask)
        w_query = self.hyper_query(query)                                   # [B, H, M, p_h]
        w_key = self.hyper_key(key)                                         # [B, H, N, p_h]
        values = value.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)  # [B, H, N, dim / H]
        if key_padding_mask is not None:
            keep = ~key_padding_mask[:, None, :, None]
            w_key = torch.where(keep, w_key, w_key.new_zeros(()))
            values = torch.where(keep, values, values.new_zeros(()))
        mixed = F.gelu(w_key.transpose(-1, -2) @ values)                    # [B, H, p_h, dim / H]: sums over N
        out = (w_query @ mixed).transpose(1, 2).flatten(2)                  # [B, M, dim]
        return out if self.norm is None else self.norm(out)
