"""Pre-norm attention layers shared by the reference models.

``ContextAttentionLayer`` is TNP-D's masked self-attention layer written without a mask: the
context tokens attend over the context, the target tokens attend over the context only, which is
one cross attention with every token as a query and the context tokens as keys. ``LatentDecoder``
is the query phase of LBANP and CMANP: ``X^i = CA(X^{i−1}, L_i)`` per layer.
"""
from __future__ import annotations

import copy
from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from attn_ext.nn import Intention, MultiheadCrossAttention, OfficialPerceiverBlock, PerceiverBlock, PreNormBlock
from attn_ext.models.linear_attention import LinearAttention
from attn_ext.nn.layer_norm import LayerNorm

#: Attention kinds of :class:`ContextAttentionLayer`: name -> factory(dim, heads) -> module(q, k, v) -> [B, M, dim].
ATTENTIONS: dict = {
    "softmax": lambda dim, heads: _FirstOutput(MultiheadCrossAttention(dim, heads, batch_first=True)),
    "intention": lambda dim, heads: Intention(dim, heads),
    "intention_paper": lambda dim, heads: Intention(dim, heads, form="paper"),
    "linear": lambda dim, heads: LinearAttention(dim, heads),
}


#: ``block`` choices of the latent models (LBANP, CMANP): ``"prenorm"``, ours; ``"perceiver"``, the
#: official LBANP/CMANP code's block structure (normalised residuals, GEGLU), which also embeds the
#: targets from x alone; ``"official"``, that structure with the official projections (bias-free q/kv,
#: ``nn.Linear`` initialisation) and, as the official ``_get_clones``, every layer of a stack a copy of one.
BLOCKS: dict = {"prenorm": PreNormBlock, "perceiver": PerceiverBlock, "official": OfficialPerceiverBlock}

#: The ``block`` choices whose stacks start as copies of one layer (see :func:`layer_stack`).
CLONED_STACKS = frozenset({"official"})


def block_class(owner: str, name: str) -> type:
    """The block class called ``name`` in :data:`BLOCKS`; ``ValueError`` naming ``owner`` otherwise."""
    if name not in BLOCKS:
        raise ValueError(f"{owner}: unknown block {name!r}; choose one of {', '.join(BLOCKS)}")
    return BLOCKS[name]


class _FirstOutput(nn.Module):
    """Adapts ``MultiheadCrossAttention``'s ``(out, None)`` to a plain output."""

    def __init__(self, attention: MultiheadCrossAttention) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self.attention(q, k, v)[0]


class ContextAttentionLayer(nn.Module):
    """``h = x + Attn(LN(x), LN(x_ctx)); h + FF(LN'(h))`` where ``x_ctx`` = the first ``num_context`` tokens.

    With ``attention="softmax"`` this equals a pre-norm ``nn.TransformerEncoderLayer`` under TNP-D's
    mask (targets see only the context, the context sees itself), without forming the mask.
    """

    def __init__(self, dim: int, num_heads: int, ff_dim: int, attention: str = "softmax") -> None:
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"unknown attention {attention!r}; choose one of {', '.join(ATTENTIONS)}")
        self.norm, self.norm_ff = LayerNorm(dim), LayerNorm(dim)
        self.attention = ATTENTIONS[attention](dim, num_heads)
        self.ff = nn.Sequential(nn.Linear(dim, ff_dim), nn.ReLU(), nn.Linear(ff_dim, dim))

    def forward(self, x: Tensor, num_context: int) -> Tensor:
        h = self.norm(x)
        context = h[:, :num_context]
        x = x + self.attention(h, context, context)
        return x + self.ff(self.norm_ff(x))

    def packed(self, context: Tensor, targets: Optional[Tensor], cu_seqlens_c: Tensor,
               cu_seqlens_t: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
        """:meth:`forward` over a packed batch: ``context [T_c, dim]``, ``targets [T_t, dim]`` (or None: the context
        alone), each task's tokens attending over its own context tokens (softmax attention only)."""
        if not isinstance(self.attention, _FirstOutput):
            raise NotImplementedError(f"ContextAttentionLayer: a packed batch needs softmax attention, this layer has "
                                      f"{type(self.attention).__name__}")
        mha = self.attention.attention
        hc = self.norm(context)
        if targets is not None:
            ht = self.norm(targets)
            targets = targets + mha.packed(ht, hc, hc, cu_seqlens_t, cu_seqlens_c)
            targets = targets + self.ff(self.norm_ff(targets))
        context = context + mha.packed(hc, hc, hc, cu_seqlens_c, cu_seqlens_c)
        return context + self.ff(self.norm_ff(context)), targets


class ContextEncoder(nn.Module):
    """A stack of :class:`ContextAttentionLayer` and a final LayerNorm over ``[context; targets]``."""

    def __init__(self, num_layers: int, dim: int, num_heads: int, ff_dim: int, attention: str = "softmax") -> None:
        super().__init__()
        self.layers = nn.ModuleList(ContextAttentionLayer(dim, num_heads, ff_dim, attention)
                                    for _ in range(num_layers))
        self.norm = LayerNorm(dim)

    def forward(self, x: Tensor, num_context: int) -> Tensor:
        for layer in self.layers:
            x = layer(x, num_context)
        return self.norm(x)

    def packed(self, context: Tensor, targets: Optional[Tensor], cu_seqlens_c: Tensor,
               cu_seqlens_t: Optional[Tensor]) -> Tensor:
        """The final target tokens ``[T_t, dim]`` of a packed batch (see :meth:`ContextAttentionLayer.packed`), or
        with ``targets`` None the final context tokens ``[T_c, dim]``."""
        for layer in self.layers:
            context, targets = layer.packed(context, targets, cu_seqlens_c, cu_seqlens_t)
        return self.norm(context if targets is None else targets)


class LatentDecoder(nn.Module):
    """The query phase ``X^i = CA(X^{i−1}, L_i)``, one cross-attention ``block`` per latent set
    (``block(dim, num_heads, ff_dim, cross=True)``: :class:`~attn_ext.nn.PreNormBlock` by default)."""

    def __init__(self, num_layers: int, dim: int, num_heads: int, ff_dim: int,
                 block: Callable[..., nn.Module] = PreNormBlock, *, cloned: bool = False) -> None:
        super().__init__()
        self.blocks = layer_stack(lambda: block(dim, num_heads, ff_dim, cross=True), num_layers, cloned=cloned)

    def forward(self, queries: Tensor, latents: Sequence[Tensor]) -> Tensor:
        if len(latents) != len(self.blocks):
            raise ValueError(f"LatentDecoder: {len(self.blocks)} blocks but {len(latents)} latent sets")
        for block, lat in zip(self.blocks, latents):
            queries = block(queries, lat)
        return queries

    def packed(self, queries: Tensor, cu_seqlens_q: Tensor, latents: Sequence[Tensor],
               cu_seqlens_latents: Tensor) -> Tensor:
        """:meth:`forward` over a packed batch: ``queries [T_q, dim]`` and each latent set ``[T_l, dim]`` packed by
        task (``cu_seqlens_*``, :meth:`~attn_ext.nn.PreNormBlock.packed`)."""
        if len(latents) != len(self.blocks):
            raise ValueError(f"LatentDecoder: {len(self.blocks)} blocks but {len(latents)} latent sets")
        for block, lat in zip(self.blocks, latents):
            queries = block.packed(queries, cu_seqlens_q, lat, cu_seqlens_latents)
        return queries


def packed_latents(latents: Tensor, cu_seqlens: Tensor) -> Tuple[Tensor, Tensor]:
    """Learned latents ``[L, dim]`` (or ``[1, L, dim]``) repeated for each task of a packed batch whose offsets are
    ``cu_seqlens`` (``[B + 1]``): ``([B·L, dim], int32 offsets [0, L, 2L, …] on the offsets' device)``."""
    latents = latents.reshape(-1, latents.shape[-1])
    tasks = cu_seqlens.numel() - 1
    offsets = torch.arange(tasks + 1, dtype=torch.int32, device=cu_seqlens.device) * latents.shape[0]
    return latents.repeat(tasks, 1), offsets


def layer_stack(factory: Callable[[], nn.Module], n: int, *, cloned: bool = False) -> nn.ModuleList:
    """``n`` modules from ``factory``: independently initialised, or with ``cloned`` ``n`` deep copies
    of one (the official LBANP/CMANP code's ``_get_clones``: every layer starts from the same
    weights, and each trains on its own)."""
    if cloned:
        first = factory()
        return nn.ModuleList(copy.deepcopy(first) for _ in range(n))
    return nn.ModuleList(factory() for _ in range(n))
