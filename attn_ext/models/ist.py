"""IST (Ashman et al. 2024): the Inducing Set Transformer NP, Set Transformer's induced set attention on the context."""
from __future__ import annotations

from typing import Optional

from torch import Tensor
from torch.distributions import Normal

from attn_ext.models.base import GaussianHead, NeuralProcess, NPConfig, check_points
from attn_ext.models.layers import layer_stack
from attn_ext.nn import PreNormBlock
from attn_ext.nn.latents import learned_latents


class IST(NeuralProcess):
    """Inducing Set Transformer NP: ``num_latents`` pseudo tokens summarise the context in every layer.

    Layer ``ℓ = 1..L`` of the encoder, with ``MAB(A, B)`` a pre-norm cross-attention block
    (:class:`~attn_ext.nn.PreNormBlock`: ``A`` attends to ``B``, then a feed-forward):

    - ``P_ℓ = MAB(P_{ℓ−1}, C_{ℓ−1})`` — the pseudo tokens read the context;
    - ``T_ℓ = MAB(T_{ℓ−1}, P_ℓ)`` — the targets read the pseudo tokens;
    - ``C_ℓ = MAB(C_{ℓ−1}, P_ℓ)`` — the context reads the pseudo tokens (skipped in the last layer,
      whose context nothing reads).

    ``C_0`` is the embedded context ``[xc, yc]``, ``T_0`` the embedded targets ``[xt, 0]`` (TNP-D's
    tokens, one embedding MLP), ``P_0`` a learned ``[num_latents, d_model]`` array drawn from
    N(0, 1); ``T_L`` goes through TNP-D's Gaussian head. The pair ``(P_ℓ, C_ℓ)`` is Set
    Transformer's induced set attention block ``ISAB(C) = MAB(C, MAB(I, C))`` (Lee et al. 2019)
    with the inducing points ``I`` carried from layer to layer, as the PT-TNP code of Ashman et al.
    does: the pseudo tokens are a running summary that each layer refines, rather than a fresh
    learned set per layer as in Set Transformer's ISAB (that differs only in where the layer's
    queries come from; the attention and the cost are the same).

    The targets read the pseudo tokens, not the updated context, following Ashman et al.'s PT-TNP
    (whose IST encoder this is): the pseudo tokens are the bottleneck through which all context
    information flows, so target cost is ``O(N_t · M)`` instead of ``O(N_t · N_c)``, and each target
    depends on the context and its own ``x`` only. The context never attends to itself: time and
    memory are ``O((N_c + N_t) · M)`` for ``M = num_latents`` pseudo tokens, linear in ``N_c``.
    Every attention is attn_ext's fused cross attention (:class:`~attn_ext.nn.MultiheadCrossAttention`).

    Sizes: :class:`~attn_ext.models.NPConfig`'s defaults (width 64, 6 layers, 4 heads, feed-forward
    128, embedding depth 4, 128 pseudo tokens, LBANP's latent count): about 0.6 million parameters.
    The chapter trains models of about a million parameters but states no configuration.

    Parameters
    ----------
    config : NPConfig, optional
        Sizes (``num_latents`` = pseudo tokens); keyword overrides are applied on top.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.models import IST
    >>> model = IST(num_layers=2, num_latents=8)
    >>> xc, yc, xt = torch.randn(2, 10, 1), torch.randn(2, 10, 1), torch.randn(2, 7, 1)
    >>> model.predict(xc, yc, xt).mean.shape
    torch.Size([2, 7, 1])
    """

    def __init__(self, config: Optional[NPConfig] = None, **overrides) -> None:
        super().__init__(config, **overrides)
        c = self.config
        if c.num_layers < 1 or c.num_latents < 1:
            raise ValueError(f"IST: num_layers and num_latents must be >= 1, got {c.num_layers}, {c.num_latents}")

        def block() -> PreNormBlock:
            return PreNormBlock(c.d_model, c.num_heads, c.ff_dim, cross=True)

        self.pseudo_tokens = learned_latents(c.num_latents, c.d_model)
        self.context_to_pseudo = layer_stack(block, c.num_layers)
        self.pseudo_to_target = layer_stack(block, c.num_layers)
        self.pseudo_to_context = layer_stack(block, c.num_layers - 1)
        self.head = GaussianHead(c.d_model, c.ff_dim, c.dim_y)

    def predict(self, xc: Tensor, yc: Tensor, xt: Tensor) -> Normal:
        """Predictive ``Normal`` over ``yt``, mean and scale ``[B, N_t, dim_y]``."""
        check_points(self, xc=xc, yc=yc, xt=xt)
        context, targets = self.embed_pairs(xc, yc), self.embed_targets(xt)
        pseudo = self.pseudo_tokens.expand(xc.shape[0], -1, -1)
        for i, (read_context, read_pseudo) in enumerate(zip(self.context_to_pseudo, self.pseudo_to_target)):
            pseudo = read_context(pseudo, context)
            targets = read_pseudo(targets, pseudo)
            if i < len(self.pseudo_to_context):
                context = self.pseudo_to_context[i](context, pseudo)
        return self.head(targets)
