"""TETNP (Ashman et al. 2024, "Translation-Equivariant Transformer Neural Processes"): TNP-D whose
attention is translation equivariant and whose tokens never see absolute inputs."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn
from torch.distributions import Normal

from attn_ext.models.base import GaussianHead, NeuralProcess, NPConfig, check_points, mlp
from attn_ext.nn.layer_norm import LayerNorm
from attn_ext.nn.te_attention import TEMultiheadAttention


def embed_from_y(embedder: nn.Module, yc: Tensor, num_targets: int) -> Tensor:
    """Initial features ``[B, N_c + N_t, d_model]`` of a translation-equivariant model's tokens, from the outputs
    alone: ``embedder([y_c, 0])`` per context point, then ``embedder([0, 1])`` per target (the flag tells them
    apart); ``x`` never enters a feature."""
    context = torch.cat([yc, yc.new_zeros(*yc.shape[:-1], 1)], -1)
    target = yc.new_zeros(yc.shape[0], num_targets, yc.shape[-1] + 1)
    target[..., -1] = 1.0
    return embedder(torch.cat([context, target], 1))


class TEContextAttentionLayer(nn.Module):
    """``z = z + TEAttn(LN(z), LN(z_ctx); x, x_ctx); z + FF(LN'(z))`` with ``z_ctx`` the first ``num_context``
    tokens: every token (context and target) attends over the context only, TNP-D's masked self
    attention written as one cross attention, as :class:`~attn_ext.models.layers.ContextAttentionLayer`."""

    def __init__(self, dim: int, num_heads: int, ff_dim: int, dim_x: int, kernel_hidden: Optional[int]) -> None:
        super().__init__()
        self.norm, self.norm_ff = LayerNorm(dim), LayerNorm(dim)
        self.attention = TEMultiheadAttention(dim, num_heads, dim_x, kernel_hidden)
        self.ff = nn.Sequential(nn.Linear(dim, ff_dim), nn.ReLU(), nn.Linear(ff_dim, dim))

    def forward(self, z: Tensor, x: Tensor, num_context: int) -> Tensor:
        h = self.norm(z)
        z = z + self.attention(h, h[:, :num_context], x, x[:, :num_context])
        return z + self.ff(self.norm_ff(z))


class TETNP(NeuralProcess):
    """Translation-equivariant TNP: TNP-D's structure on :class:`~attn_ext.nn.te_attention.TEMultiheadAttention`.

    Each token carries features ``z`` and its fixed input ``x``. The initial features come from the
    outputs alone: ``MLP([y_c, 0])`` for a context point and ``MLP([0, 1])`` for a target (the flag
    tells them apart); ``x`` enters only through the pairwise differences ``x_i − x_j`` in the
    attention logits, so shifting every input of a task by one vector leaves its predictions
    unchanged. In each layer the context tokens attend over the context and the targets attend over
    the context only, so one target's prediction never depends on another target.

    The attention is the fused op :func:`attn_ext.te_attention` (through
    :class:`~attn_ext.nn.te_attention.TEMultiheadAttention`): its logits, an MLP of the per-head dot products and of
    ``x_i − x_j``, are computed tile by tile and recomputed in the backward, so training and prediction alike take
    memory linear in ``N_c + N_t``; time is quadratic in ``N_c`` (context self attention).

    Sizes: ``d_model`` token width, ``num_layers`` layers, ``num_heads`` heads, ``ff_dim`` feed-forward
    width, ``emb_depth`` layers of the ``y`` embedding; ``num_latents`` is unused. At the library's
    defaults (64, 6, 4, 128, 4) this is about 0.23M parameters; ``d_model=128, num_heads=8,
    num_layers=6, ff_dim=256`` gives about 0.89M, close to the chapter's ~1M-parameter models (the
    chapter does not give their layout).

    Parameters
    ----------
    config, **overrides
        Sizes (:class:`~attn_ext.models.NPConfig`); ``dim_x`` 1 or more (tested for 1 and 2).
    kernel_hidden : int, optional
        Hidden width of the logit MLP ``ρ`` (default ``d_model``).

    Examples
    --------
    >>> import torch
    >>> from attn_ext.models import TETNP
    >>> model = TETNP(d_model=16, num_layers=2, num_heads=2, ff_dim=32, emb_depth=2)
    >>> xc, yc, xt = torch.randn(2, 10, 1), torch.randn(2, 10, 1), torch.randn(2, 7, 1)
    >>> pred = model.predict(xc, yc, xt)
    >>> pred.mean.shape, torch.allclose(pred.mean, model.predict(xc - 4.0, yc, xt - 4.0).mean, atol=1e-5)
    (torch.Size([2, 7, 1]), True)
    """

    def __init__(self, config: Optional[NPConfig] = None, *, kernel_hidden: Optional[int] = None,
                 **overrides) -> None:
        super().__init__(config, **overrides)
        c = self.config
        if c.num_heads < 1 or c.d_model % c.num_heads:
            raise ValueError(f"TETNP: num_heads={c.num_heads} must divide d_model={c.d_model}")
        self.kernel_hidden = c.d_model if kernel_hidden is None else int(kernel_hidden)
        # Absolute inputs must never reach the token features, so the base class's [x, y] embedder
        # is replaced by one of [y, is-target flag].
        self.embedder = None
        self.token_embedder = mlp(c.dim_y + 1, c.d_model, c.d_model, c.emb_depth)
        self.layers = nn.ModuleList(TEContextAttentionLayer(c.d_model, c.num_heads, c.ff_dim, c.dim_x,
                                                            self.kernel_hidden) for _ in range(c.num_layers))
        self.norm = LayerNorm(c.d_model)
        self.head = GaussianHead(c.d_model, c.ff_dim, c.dim_y)

    def options(self) -> dict:
        """``kernel_hidden``, the width of the logit MLP."""
        return {"kernel_hidden": self.kernel_hidden}

    def embed_pairs(self, x: Tensor, y: Optional[Tensor]) -> Tensor:
        raise TypeError("TETNP has no [x, y] embedding: its tokens are embedded from y alone (embed_tokens)")

    def embed_tokens(self, yc: Tensor, num_targets: int) -> Tensor:
        """Initial features ``[B, N_c + N_t, d_model]``: ``MLP([y_c, 0])`` then ``MLP([0, 1])`` per target."""
        return embed_from_y(self.token_embedder, yc, num_targets)

    def predict(self, xc: Tensor, yc: Tensor, xt: Tensor) -> Normal:
        """Predictive ``Normal`` over ``yt``, mean and scale ``[B, N_t, dim_y]``."""
        check_points(self, xc=xc, yc=yc, xt=xt)
        num_context = xc.shape[1]
        z, x = self.embed_tokens(yc, xt.shape[1]), torch.cat([xc, xt], 1)
        for layer in self.layers:
            z = layer(z, x, num_context)
        return self.head(self.norm(z[:, num_context:]))
