"""Transformer + Cross Attention: Tree Cross Attention's full-attention baseline (Feng et al., 2023).

A Transformer encoder over the context only, then one cross attention of every target over all the
encoded context tokens. It is ReTreever with its tree cross attention replaced by full cross
attention, so the two differ only in how many tokens a target reads (all ``N_c`` here).
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor
from torch.distributions import Normal

from attn_ext.models.base import GaussianHead, NeuralProcess, NPConfig, check_points
from attn_ext.models.layers import ContextEncoder
from attn_ext.nn import MultiheadCrossAttention


class TransformerCA(NeuralProcess):
    """Transformer encoder over ``[xc, yc]``, then one cross attention of the targets over it.

    The context embeddings go through ``num_layers`` pre-norm self-attention layers
    (:class:`attn_ext.models.layers.ContextEncoder` with no target tokens: the encoder is
    ``N_c × d → N_c × d`` and independent of the targets). Each target's embedding ``q = emb([xt, 0])``
    then reads every encoded context token once, through attn_ext's fused
    :class:`~attn_ext.nn.MultiheadCrossAttention`, and the Gaussian head reads ``q + CA(q, context)``
    (the same read-out as :class:`~attn_ext.models.ReTreever`, whose ``CA`` is a tree cross attention).
    Targets never see each other, so a prediction does not depend on the other targets.

    Sizes default to the Tree Cross Attention paper's NP setting (6 encoder layers, d 64, 4 heads,
    feed-forward 128, as ReTreever, TNP-D and LBANP's official configuration).

    Parameters
    ----------
    config : NPConfig, optional
        Sizes; keyword overrides are applied on top (``num_latents`` is unused).

    Examples
    --------
    >>> import torch
    >>> from attn_ext.models import TransformerCA
    >>> from attn_ext.data import GPSampler
    >>> model = TransformerCA(num_layers=2, d_model=32)
    >>> batch = GPSampler().sample(4, generator=torch.Generator().manual_seed(0))
    >>> bool(torch.isfinite(model(batch)))
    True
    >>> model.predict(batch.xc, batch.yc, batch.xt).mean.shape == batch.yt.shape
    True
    """

    def __init__(self, config: Optional[NPConfig] = None, **overrides) -> None:
        super().__init__(config, **overrides)
        c = self.config
        self.encoder = ContextEncoder(c.num_layers, c.d_model, c.num_heads, c.ff_dim, "softmax")
        self.cross_attention = MultiheadCrossAttention(c.d_model, c.num_heads)
        self.head = GaussianHead(c.d_model, c.ff_dim, c.dim_y)

    def encode(self, xc: Tensor, yc: Tensor) -> Tensor:
        """``[B, N_c, d_model]``: the context after the Transformer encoder (once per context)."""
        check_points(self, xc=xc, yc=yc)
        return self.encoder(self.embed_pairs(xc, yc), xc.shape[1])

    def predict(self, xc: Tensor, yc: Tensor, xt: Tensor) -> Normal:
        """Predictive ``Normal`` over ``yt``, mean and scale ``[B, N_t, dim_y]``."""
        check_points(self, xc=xc, yc=yc, xt=xt)
        context = self.encode(xc, yc)
        query = self.embed_pairs(xt, None)
        return self.head(query + self.cross_attention(query, context, context)[0])

    def predict_packed(self, xc: Tensor, yc: Tensor, xt: Tensor, cu_seqlens_c: Tensor, cu_seqlens_t: Tensor) -> Normal:
        """Predictive ``Normal`` over the packed targets ``[T_t, dim_y]`` of tasks packed end to end (the layout of
        :class:`~attn_ext.data.PackedNPBatch`): each task's context encoded over itself, its targets reading it, by
        :func:`attn_ext.varlen_attention`; per task, what :meth:`predict` gives it alone."""
        context = self.encoder.packed(self.embed_pairs(xc, yc), None, cu_seqlens_c, None)
        query = self.embed_pairs(xt, None)
        return self.head(query + self.cross_attention.packed(query, context, context, cu_seqlens_t, cu_seqlens_c))
