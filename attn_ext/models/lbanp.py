"""LBANP (Feng et al. 2023): Perceiver-style latents ``L_i = SA(CA(L_{i−1}, D))``, queries read the latents."""
from __future__ import annotations

from typing import Optional

from torch import Tensor
from torch.distributions import Normal

from attn_ext.models.base import GaussianHead, NeuralProcess, NPConfig, check_points, mlp
from attn_ext.models.layers import CLONED_STACKS, LatentDecoder, block_class, layer_stack, packed_latents
from attn_ext.nn.latents import learned_latents


class LBANP(NeuralProcess):
    """Latent Bottlenecked Attentive NP: ``num_latents`` learned latents updated per layer by a cross
    attention over the embedded context and a self attention; targets ``X^i = CA(X^{i−1}, L_i)``.
    Memory O(N_c · num_latents) in the conditioning phase (linear in ``N_c``).

    Parameters
    ----------
    config, **overrides
        Sizes (:class:`~attn_ext.models.NPConfig`).
    block : {"prenorm", "perceiver", "official"}
        ``"prenorm"`` (default): every block is a :class:`~attn_ext.nn.PreNormBlock` and the targets
        are embedded as ``[x, 0]`` by the context's embedder, as TNP-D does. ``"perceiver"``: the
        official LBANP code's structure, :class:`~attn_ext.nn.PerceiverBlock` (normalised residuals,
        GEGLU) everywhere and a separate ``x``-only embedder for the targets. ``"official"``: that,
        with :class:`~attn_ext.nn.OfficialPerceiverBlock` (bias-free q/kv projections initialised as
        ``nn.Linear``) and each stack's layers starting as copies of one, as the official code does.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.models import LBANP
    >>> model = LBANP(num_layers=2, num_latents=8)
    >>> xc, yc, xt = torch.randn(2, 10, 1), torch.randn(2, 10, 1), torch.randn(2, 7, 1)
    >>> model.predict(xc, yc, xt).mean.shape
    torch.Size([2, 7, 1])
    """

    def __init__(self, config: Optional[NPConfig] = None, *, block: str = "prenorm", **overrides) -> None:
        super().__init__(config, **overrides)
        c, Block, self.block = self.config, block_class("LBANP", block), block
        self.latents = learned_latents(c.num_latents, c.d_model)
        cloned = block in CLONED_STACKS
        self.cross = layer_stack(lambda: Block(c.d_model, c.num_heads, c.ff_dim, cross=True), c.num_layers,
                                 cloned=cloned)
        self.self_attention = layer_stack(lambda: Block(c.d_model, c.num_heads, c.ff_dim, cross=False),
                                          c.num_layers, cloned=cloned)
        self.decoder = LatentDecoder(c.num_layers, c.d_model, c.num_heads, c.ff_dim, block=Block, cloned=cloned)
        if block != "prenorm":
            self.query_embedder = mlp(c.dim_x, c.d_model, c.d_model, c.emb_depth)
        self.head = GaussianHead(c.d_model, c.ff_dim, c.dim_y)

    def options(self) -> dict:
        """``block`` (what ``python -m bench train gp --block`` sets in the repository's harness)."""
        return {"block": self.block}

    def predict(self, xc: Tensor, yc: Tensor, xt: Tensor) -> Normal:
        check_points(self, xc=xc, yc=yc, xt=xt)
        context = self.embed_pairs(xc, yc)
        latent = self.latents.expand(xc.shape[0], -1, -1)
        latents = []
        for cross, self_attention in zip(self.cross, self.self_attention):
            latent = self_attention(cross(latent, context))
            latents.append(latent)
        return self.head(self.decoder(self.embed_targets(xt), latents))

    def predict_packed(self, xc: Tensor, yc: Tensor, xt: Tensor, cu_seqlens_c: Tensor, cu_seqlens_t: Tensor) -> Normal:
        """Predictive ``Normal`` over the packed targets ``[T_t, dim_y]`` of tasks packed end to end (the layout of
        :class:`~attn_ext.data.PackedNPBatch`): each task's latents (the learned ones, repeated) attend over its own
        context, its targets over its own latents, by :func:`attn_ext.varlen_attention`; per task, what
        :meth:`predict` gives it alone."""
        context = self.embed_pairs(xc, yc)
        latent, cu_latents = packed_latents(self.latents, cu_seqlens_c)
        latents = []
        for cross, self_attention in zip(self.cross, self.self_attention):
            latent = self_attention.packed(cross.packed(latent, cu_latents, context, cu_seqlens_c), cu_latents)
            latents.append(latent)
        return self.head(self.decoder.packed(self.embed_targets(xt), cu_seqlens_t, latents, cu_latents))
