"""``PerceiverBlock``: the attention + feed-forward block of the official LBANP code (Perceiver-style).

It differs from :class:`~attn_ext.nn.PreNormBlock` in two ways that change how a stack trains:
each sub-block's residual is the *normalised* input, ``LN(x) + f(LN(x))``, so the residual stream
is renormalised at every sub-block instead of growing; and the feed-forward is a GEGLU,
``Linear(dim, 2·ff_dim) → a·GELU(g) → Linear(ff_dim, dim)``.
"""
from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn

from attn_ext.nn.prenorm_block import PreNormBlock


class GEGLU(nn.Module):
    """``a · GELU(g)`` of the two halves ``[a, g]`` of the last dimension (Shazeer 2020)."""

    def forward(self, x: Tensor) -> Tensor:
        value, gate = x.chunk(2, dim=-1)
        return value * F.gelu(gate)


class PerceiverBlock(PreNormBlock):
    """``h = LN(x) + Attn(LN(x), LN'(c), LN'(c)); LN''(h) + FF(LN''(h))`` with a GEGLU ``FF``.

    The parameters are :class:`~attn_ext.nn.PreNormBlock`'s; ``ff_dim`` is the GEGLU's hidden width
    (its first Linear is ``2·ff_dim`` wide).

    Notes
    -----
    The official code's query and key/value projections have no bias; here they are
    :class:`~attn_ext.nn.MultiheadCrossAttention`'s, with bias. A key bias shifts every score of a
    query by the same amount, so it cancels in the softmax; the query and value biases are extra
    parameters that start at zero.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.nn import PerceiverBlock
    >>> block = PerceiverBlock(dim=16, num_heads=2, ff_dim=32, cross=False)
    >>> block(torch.randn(3, 8, 16)).shape
    torch.Size([3, 8, 16])
    """

    @staticmethod
    def feed_forward_net(dim: int, ff_dim: int) -> nn.Module:
        return nn.Sequential(nn.Linear(dim, 2 * ff_dim), GEGLU(), nn.Linear(ff_dim, dim))

    def finish(self, x: Tensor, normed: Tensor, attended: Tensor) -> Tensor:
        """``LN''(h) + FF(LN''(h))`` of ``h = LN(x) + attended``: the residuals start from the normalised input."""
        h = self.norm_ff(normed + attended)
        return h + self.ff(h)


class OfficialPerceiverBlock(PerceiverBlock):
    """:class:`PerceiverBlock` with the official LBANP/CMANP code's attention projections.

    The official ``Attention`` builds its projections from ``nn.Linear``: ``to_q`` and ``to_kv``
    without bias, ``to_out`` with one, each initialised as ``nn.Linear`` is (uniform in
    ``±1/sqrt(fan_in)``). Here the query/key/value projections have no bias either and the same
    initialisation; :class:`~attn_ext.nn.MultiheadCrossAttention` otherwise starts them as
    ``nn.MultiheadAttention`` does (Xavier-uniform, 1.22× wider at ``dim`` 64, zero biases). Wider
    initial projections give larger initial scores, and the scores' growth is what made the
    128-latent Perceiver LBANP spike here; the block exists to train the official model exactly.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.nn import OfficialPerceiverBlock
    >>> block = OfficialPerceiverBlock(dim=16, num_heads=2, ff_dim=32, cross=True)
    >>> block.attention.in_proj_bias is None, block(torch.randn(3, 8, 16), torch.randn(3, 5, 16)).shape
    (True, torch.Size([3, 8, 16]))
    """

    def __init__(self, dim: int, num_heads: int, ff_dim: int, cross: bool) -> None:
        super().__init__(dim, num_heads, ff_dim, cross)
        attention = self.attention
        attention.register_parameter("in_proj_bias", None)
        # nn.Linear's default: kaiming_uniform(a=sqrt(5)) is uniform(±1/sqrt(fan_in)), fan_in = dim.
        nn.init.kaiming_uniform_(attention.in_proj_weight, a=math.sqrt(5))
        attention.out_proj.reset_parameters()
