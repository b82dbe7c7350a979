"""HyperMixNP: TNP-D with HyperMixer token mixing in place of attention (the efficient-NP-transformers chapter)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn
from torch.distributions import Normal

from attn_ext.models.base import GaussianHead, NeuralProcess, NPConfig, check_points
from attn_ext.nn.hypermixer import HyperMixer
from attn_ext.nn.layer_norm import LayerNorm


class HyperMixLayer(nn.Module):
    """``h = x + Mix(LN(x), LN(x_ctx)); h + FF(LN'(h))``, ``x_ctx`` = the first ``num_context`` tokens.

    TNP-D's pre-norm encoder layer (:class:`attn_ext.models.layers.ContextAttentionLayer`) with a
    :class:`~attn_ext.nn.HyperMixer` as the mixing: every token is a query, the context tokens are
    the keys and values, so a target reads the context only, never another target.
    """

    def __init__(self, dim: int, num_heads: int, ff_dim: int, mixing_dim: int) -> None:
        super().__init__()
        self.norm, self.norm_ff = LayerNorm(dim), LayerNorm(dim)
        self.mixer = HyperMixer(dim, mixing_dim, num_heads)
        self.ff = nn.Sequential(nn.Linear(dim, ff_dim), nn.ReLU(), nn.Linear(ff_dim, dim))

    def forward(self, x: Tensor, num_context: int) -> Tensor:
        h = self.norm(x)
        context = h[:, :num_context]
        x = x + self.mixer(h, context, context)
        return x + self.ff(self.norm_ff(x))


class HyperMixNP(NeuralProcess):
    """HyperMixNP: the TNP-D model with each attention replaced by HyperMixer token mixing.

    The tokens are TNP-D's: ``[xc, yc]`` and ``[xt, 0]`` through one embedding MLP. Each of the
    ``num_layers`` pre-norm layers mixes all ``N_c + N_t`` tokens (the queries) from the ``N_c``
    context tokens (keys and values) with a :class:`~attn_ext.nn.HyperMixer`, ``H = W_q σ(W_kᵀ V)``,
    then applies a feed-forward block; a final LayerNorm and TNP-D's Gaussian head give the
    predictions at the targets. As in TNP-D, the context never reads the targets and a target's
    prediction depends on the context and on its own ``x`` only.

    Time and memory are linear in ``N_c + N_t`` (the context enters each layer through one
    ``p × d`` matrix per head), where TNP-D's time is quadratic. Unlike TNP-D's attention, the
    mixing has no softmax over the context: a sum over the context points feeds a GELU, so the model
    is not translation equivariant and its features are not normalised over ``N_c`` (the mixer's
    output LayerNorm restores the scale).

    Sizes: :class:`~attn_ext.models.NPConfig`'s defaults (TNP-D's: width 64, 6 layers, 4 heads,
    feed-forward 128, embedding depth 4). The chapter trains models of about a million parameters
    but states no configuration; at the defaults this model has about 0.16 million (TNP-D about
    0.22 million). The mixer's hypernetworks are two-layer MLPs of hidden width ``d_model`` (the
    authors' choice) generating ``mixing_dim = ff_dim`` weights over ``num_heads`` heads: the
    token-mixing MLP gets the hidden width of the feature-mixing one.

    Parameters
    ----------
    config : NPConfig, optional
        Sizes; keyword overrides are applied on top, e.g. ``HyperMixNP(num_layers=2)``.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.models import HyperMixNP
    >>> model = HyperMixNP(num_layers=2)
    >>> xc, yc, xt = torch.randn(2, 10, 1), torch.randn(2, 10, 1), torch.randn(2, 7, 1)
    >>> model.predict(xc, yc, xt).mean.shape
    torch.Size([2, 7, 1])
    """

    def __init__(self, config: Optional[NPConfig] = None, **overrides) -> None:
        super().__init__(config, **overrides)
        c = self.config
        self.layers = nn.ModuleList(HyperMixLayer(c.d_model, c.num_heads, c.ff_dim, mixing_dim=c.ff_dim)
                                    for _ in range(c.num_layers))
        self.norm = LayerNorm(c.d_model)
        self.head = GaussianHead(c.d_model, c.ff_dim, c.dim_y)

    def predict(self, xc: Tensor, yc: Tensor, xt: Tensor) -> Normal:
        """Predictive ``Normal`` over ``yt``, mean and scale ``[B, N_t, dim_y]``."""
        check_points(self, xc=xc, yc=yc, xt=xt)
        num_context = xc.shape[1]
        h = torch.cat([self.embed_pairs(xc, yc), self.embed_targets(xt)], 1)
        for layer in self.layers:
            h = layer(h, num_context)
        return self.head(self.norm(h[:, num_context:]))
