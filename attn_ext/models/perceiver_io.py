"""Perceiver IO (Jaegle et al., 2021) as a Neural Process: Tree Cross Attention's equal-token-budget baseline.

Learned latents read the context by cross attention and mix by self attention, ``num_layers``
times; the targets then read only the final latents, by one cross attention. A target therefore
reads ``num_latents`` tokens, whatever the context size; the Tree Cross Attention paper compares it
with ReTreever "at an equal token budget", i.e. with as many latents as tree nodes ReTreever reads.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor, nn
from torch.distributions import Normal

from attn_ext.models.base import GaussianHead, NeuralProcess, NPConfig, check_points
from attn_ext.models.layers import packed_latents
from attn_ext.nn import MultiheadCrossAttention, PreNormBlock, learned_latents
from attn_ext.nn.layer_norm import LayerNorm
from attn_ext.ops.tree import tree_num_selected

#: Largest context of the GP regression task (the official sampler draws ``N_c`` in ``[3, 47)``).
GP_MAX_CONTEXT = 46


def equal_token_budget(num_context: int, branching: int = 2) -> int:
    """Latents of a Perceiver IO that reads as many tokens per target as Tree Cross Attention does.

    Tree Cross Attention with branching ``b`` over ``num_context`` tokens reads
    ``tree_num_selected(num_context, b)`` tree nodes per query; this returns that number.

    Examples
    --------
    >>> from attn_ext.models.perceiver_io import equal_token_budget
    >>> equal_token_budget(46), equal_token_budget(256)    # GP task (paper: 14.9 %), copy task N = 512
    (7, 9)
    """
    return tree_num_selected(num_context, branching)


class PerceiverIONP(NeuralProcess):
    """Perceiver IO NP: ``L ← SA(CA(L, context))`` per layer, then the targets read ``L`` once.

    The context ``[xc, yc]`` is embedded; ``num_latents`` learned latents (N(0, 1) initialised)
    go through ``num_layers`` iterative-attention blocks, each a pre-norm cross attention over the
    context followed by a pre-norm self attention over the latents (:class:`~attn_ext.nn.PreNormBlock`
    on attn_ext's fused attention). Each target's embedding ``q = emb([xt, 0])`` reads the final
    latents through one :class:`~attn_ext.nn.MultiheadCrossAttention` and the Gaussian head reads
    ``q + CA(q, L)`` (the read-out of :class:`~attn_ext.models.TransformerCA` and ReTreever).
    Unlike LBANP, whose targets read every layer's latents, only the last latents are read, so a
    target reads exactly ``num_latents`` tokens: :attr:`tokens_per_target`.

    The default ``num_latents`` is 7, ReTreever's budget on the GP task
    (:func:`equal_token_budget` of its largest context, 46 points: the paper's 14.9 % of the tokens);
    set ``num_latents`` for another budget. The other sizes are the NP setting of the Tree Cross
    Attention paper (6 blocks, d 64, 4 heads, feed-forward 128).

    Parameters
    ----------
    config : NPConfig, optional
        Sizes; keyword overrides on top. When neither gives ``num_latents`` the budget above is used
        (:class:`NPConfig`'s 128 is LBANP's and not an equal budget).

    Examples
    --------
    >>> import torch
    >>> from attn_ext.models import PerceiverIONP
    >>> from attn_ext.data import GPSampler
    >>> model = PerceiverIONP(num_layers=2, d_model=32)
    >>> model.tokens_per_target
    7
    >>> batch = GPSampler().sample(4, generator=torch.Generator().manual_seed(0))
    >>> bool(torch.isfinite(model(batch)))
    True
    >>> model.predict(batch.xc, batch.yc, batch.xt).mean.shape == batch.yt.shape
    True
    """

    def __init__(self, config: Optional[NPConfig] = None, **overrides) -> None:
        if config is None and "num_latents" not in overrides:
            overrides["num_latents"] = equal_token_budget(GP_MAX_CONTEXT)
        super().__init__(config, **overrides)
        c = self.config
        if not isinstance(c.num_latents, int) or c.num_latents < 1:
            raise ValueError(f"PerceiverIONP: num_latents must be a positive int, got {c.num_latents!r}")
        self.latents = learned_latents(c.num_latents, c.d_model)
        self.read_context = nn.ModuleList(PreNormBlock(c.d_model, c.num_heads, c.ff_dim, cross=True)
                                    for _ in range(c.num_layers))
        self.mix_latents = nn.ModuleList(PreNormBlock(c.d_model, c.num_heads, c.ff_dim, cross=False)
                                   for _ in range(c.num_layers))
        # The pre-norm residual stream is never normalised inside the blocks; the read-out attends over
        # normalised latents, as the other models' context encoders end with a LayerNorm.
        self.norm_latents = LayerNorm(c.d_model)
        self.cross_attention = MultiheadCrossAttention(c.d_model, c.num_heads)
        self.head = GaussianHead(c.d_model, c.ff_dim, c.dim_y)

    @property
    def tokens_per_target(self) -> int:
        """Tokens each target reads at inference: the number of latents."""
        return self.config.num_latents

    def encode(self, xc: Tensor, yc: Tensor) -> Tensor:
        """``[B, num_latents, d_model]``: the latents after the iterative attention encoder."""
        check_points(self, xc=xc, yc=yc)
        context = self.embed_pairs(xc, yc)
        latents = self.latents.expand(xc.shape[0], -1, -1)
        for read, mix in zip(self.read_context, self.mix_latents):
            latents = mix(read(latents, context))
        return self.norm_latents(latents)

    def predict(self, xc: Tensor, yc: Tensor, xt: Tensor) -> Normal:
        """Predictive ``Normal`` over ``yt``, mean and scale ``[B, N_t, dim_y]``."""
        check_points(self, xc=xc, yc=yc, xt=xt)
        latents = self.encode(xc, yc)
        query = self.embed_pairs(xt, None)
        return self.head(query + self.cross_attention(query, latents, latents)[0])

    def predict_packed(self, xc: Tensor, yc: Tensor, xt: Tensor, cu_seqlens_c: Tensor, cu_seqlens_t: Tensor) -> Normal:
        """Predictive ``Normal`` over the packed targets ``[T_t, dim_y]`` of tasks packed end to end (the layout of
        :class:`~attn_ext.data.PackedNPBatch`): each task's latents (the learned ones, repeated) read its own
        context, its targets its own latents, by :func:`attn_ext.varlen_attention`; per task, what :meth:`predict`
        gives it alone."""
        context = self.embed_pairs(xc, yc)
        latents, cu_latents = packed_latents(self.latents, cu_seqlens_c)
        for read, mix in zip(self.read_context, self.mix_latents):
            latents = mix.packed(read.packed(latents, cu_latents, context, cu_seqlens_c), cu_latents)
        latents = self.norm_latents(latents)
        query = self.embed_pairs(xt, None)
        return self.head(query + self.cross_attention.packed(query, latents, latents, cu_seqlens_t, cu_latents))
