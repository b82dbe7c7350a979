"""``PreNormBlock``: the pre-norm residual attention + feed-forward block of CMAB, LBANP and the
latent decoders of the reference models (docs/spec.md §2)."""
from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor, nn

from attn_ext.nn.layer_norm import LayerNorm
from attn_ext.nn.multihead_cross_attention import MultiheadCrossAttention


class PreNormBlock(nn.Module):
    """``h = x + Attn(LN(x), LN'(c), LN'(c)); h + FF(LN''(h))`` (self attention when ``cross=False``).

    Parameters
    ----------
    dim : int
        Width of the tokens (queries and context).
    num_heads : int
        Attention heads (must divide ``dim``).
    ff_dim : int
        Hidden width of the feed-forward ``Linear(dim, ff_dim) → ReLU → Linear(ff_dim, dim)``.
    cross : bool
        True: the block attends over a ``context`` with its own LayerNorm; False: over its queries.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.nn import PreNormBlock
    >>> block = PreNormBlock(dim=16, num_heads=2, ff_dim=32, cross=True)
    >>> block(torch.randn(3, 8, 16), torch.randn(3, 40, 16)).shape
    torch.Size([3, 8, 16])
    """

    def __init__(self, dim: int, num_heads: int, ff_dim: int, cross: bool) -> None:
        super().__init__()
        self.norm_query = LayerNorm(dim)
        # Queries and context come from different distributions, so a cross attention gets its own
        # context norm (as in Perceiver); a self attention attends over its normalised queries.
        self.norm_context = LayerNorm(dim) if cross else None
        self.attention = MultiheadCrossAttention(dim, num_heads, batch_first=True)
        self.norm_ff = LayerNorm(dim)
        self.ff = self.feed_forward_net(dim, ff_dim)

    @staticmethod
    def feed_forward_net(dim: int, ff_dim: int) -> nn.Module:
        """``Linear(dim, ff_dim) → ReLU → Linear(ff_dim, dim)``; a subclass may build another."""
        return nn.Sequential(nn.Linear(dim, ff_dim), nn.ReLU(), nn.Linear(ff_dim, dim))

    def feed_forward(self, h: Tensor) -> Tensor:
        """The second half of the block: ``h + FF(LN''(h))``."""
        return h + self.ff(self.norm_ff(h))

    def attend(self, x: Tensor, context: Optional[Tensor], context_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """``(LN(x), Attn(LN(x), LN'(c), LN'(c)))``: the normalised queries and the attention output."""
        if self.norm_context is not None and context is None:
            raise ValueError(f"{type(self).__name__}(cross=True) needs a context [B, N, dim]")
        q = self.norm_query(x)
        c = q if self.norm_context is None else self.norm_context(context)
        return q, self.attention(q, c, c, key_padding_mask=context_mask)[0]

    def finish(self, x: Tensor, normed: Tensor, attended: Tensor) -> Tensor:
        """The block's output from its input ``x``, ``LN(x)`` and the attention output: here
        ``x + attended`` through :meth:`feed_forward` (a subclass may take another residual)."""
        return self.feed_forward(x + attended)

    def forward(self, x: Tensor, context: Optional[Tensor] = None, context_mask: Optional[Tensor] = None) -> Tensor:
        return self.finish(x, *self.attend(x, context, context_mask))

    def packed(self, x: Tensor, cu_seqlens_x: Tensor, context: Optional[Tensor] = None,
               cu_seqlens_context: Optional[Tensor] = None) -> Tensor:
        """:meth:`forward` over a packed batch (the layout of :func:`attn_ext.varlen_attention`): ``x [T_x, dim]``,
        sequence ``b`` its rows ``cu_seqlens_x[b]:cu_seqlens_x[b + 1]``, attending over its own rows of ``context
        [T_c, dim]`` (``cu_seqlens_context``; a self-attention block over its own rows of ``x``). Row for row what
        :meth:`forward` gives each sequence alone; no padding is formed."""
        if (self.norm_context is None) != (context is None) or (context is None) != (cu_seqlens_context is None):
            kind = "cross=True needs a context and its cu_seqlens" if self.norm_context is not None else \
                "cross=False attends over x itself: pass no context"
            raise ValueError(f"{type(self).__name__}.packed: {kind}")
        q = self.norm_query(x)
        c, cu_c = (q, cu_seqlens_x) if context is None else (self.norm_context(context), cu_seqlens_context)
        return self.finish(x, q, self.attention.packed(q, c, c, cu_seqlens_x, cu_c))
