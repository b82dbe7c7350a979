"""Informer (the Intention paper's Transformer with self-Intention): ``InformerLayer`` and the stack ``Informer``."""
from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from attn_ext.nn.intention import Intention
from attn_ext.nn.layer_norm import LayerNorm


class InformerLayer(nn.Module):
    """Residual block: self-(σ)Intention, then an MLP, with LayerNorms placed as ``norm_first`` says.

    ``norm_first=True`` (default, this module's behaviour so far), pre-norm::

        x = x + Intention(LN₁(x));   x = x + MLP(LN₂(x))

    ``norm_first=False``, post-norm, the paper's Informer layer (its anomaly-detection appendix) and
    :class:`torch.nn.TransformerEncoderLayer`'s default::

        x = LN₁(x + Intention(x));   x = LN₂(x + MLP(x))

    The default is not torch's (``False``) because switching it would silently change existing
    models; pass ``norm_first=False`` for the paper's layer.

    Parameters
    ----------
    dim, num_heads : int
    hidden_dim : int, optional
        Hidden width of the MLP (Linear, ReLU, Linear; default ``2 * dim``).
    norm_first : bool
    **intention_kwargs
        Passed to :class:`~attn_ext.nn.Intention` (e.g. ``form="paper"``, ``sigma=True``).

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> ae.nn.InformerLayer(32, 4)(torch.randn(2, 10, 32)).shape
    torch.Size([2, 10, 32])
    >>> ae.nn.InformerLayer(32, 4, norm_first=False, form="paper")(torch.randn(2, 10, 32)).shape
    torch.Size([2, 10, 32])
    """

    def __init__(self, dim: int, num_heads: int = 1, hidden_dim: Optional[int] = None, norm_first: bool = True,
                 **intention_kwargs) -> None:
        super().__init__()
        self.norm_first = bool(norm_first)
        self.norm_attention, self.norm_mlp = LayerNorm(dim), LayerNorm(dim)
        self.intention = Intention(dim, num_heads, **intention_kwargs)
        hidden = hidden_dim or 2 * dim
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))

    def forward(self, x: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        """``[B, L, dim]`` to ``[B, L, dim]``; ``key_padding_mask [B, L]`` (True = padding): not used as keys."""
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.intention.dim:
            raise ValueError(f"InformerLayer: x must be [B, L, {self.intention.dim}], "
                             f"got {tuple(getattr(x, 'shape', ()))}")
        if self.norm_first:
            h = self.norm_attention(x)
            x = x + self.intention(h, h, h, key_padding_mask)
            return x + self.mlp(self.norm_mlp(x))
        x = self.norm_attention(x + self.intention(x, x, x, key_padding_mask))
        return self.norm_mlp(x + self.mlp(x))


class Informer(nn.Module):
    """A stack of :class:`InformerLayer`, with a final LayerNorm after pre-norm layers.

    ``final_norm`` defaults to ``norm_first``: pre-norm layers leave their output unnormalised, so
    the stack ends in a LayerNorm (as before); post-norm layers already end in one.

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> ae.nn.Informer(2, 32, 4)(torch.randn(2, 10, 32)).shape
    torch.Size([2, 10, 32])
    """

    def __init__(self, num_layers: int, dim: int, num_heads: int = 1, hidden_dim: Optional[int] = None,
                 norm_first: bool = True, final_norm: Optional[bool] = None, **intention_kwargs) -> None:
        super().__init__()
        if num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {num_layers}")
        self.layers = nn.ModuleList(InformerLayer(dim, num_heads, hidden_dim, norm_first, **intention_kwargs)
                                    for _ in range(num_layers))
        self.norm = LayerNorm(dim) if (norm_first if final_norm is None else final_norm) else None

    def forward(self, x: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        for layer in self.layers:
            x = layer(x, key_padding_mask)
        return x if self.norm is None else self.norm(x)
