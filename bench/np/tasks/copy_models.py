"""Models and tree designs of the copy task (:mod:`bench.np.tasks.copy`).

``CopyModel`` is the tree / full cross attention model of kinds ``tca`` and ``ca``;
``PerceiverCopyModel`` the Perceiver IO baseline of kind ``perceiver``; :func:`tree_key` the sort
key that lays the context out over the tree's leaves (the tree-design ablation).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from attn_ext.nn import MultiheadCrossAttention, PreNormBlock, TreeCrossAttention, learned_latents

BOS, EOS, VOCAB = 10, 11, 12

#: Tree designs (Tree Cross Attention, Table 6): how the context tokens are ordered over the leaves.
TREE_DESIGNS = ("position", "random", "kd-x0", "kd-x1", "kd-rp")


def position_features(pos: Tensor, seq_len: int, num_freq: int = 6) -> Tensor:
    """``[.., 2 + 2·num_freq]``: p, p² and Fourier features of ``p = pos / seq_len``.

    p and p² let a mean over a subtree (a node embedding) still say where the subtree lies, which
    the policy needs to choose the child that contains the wanted position; the Fourier features
    let the final attention single out one position among neighbours.
    """
    p = pos.float().unsqueeze(-1) / seq_len
    freq = math.pi * 2.0 ** torch.arange(num_freq, dtype=torch.float32)
    return torch.cat([p, p * p, torch.sin(p * freq), torch.cos(p * freq)], dim=-1)


def grid_coords(num_context: int) -> Tensor:
    """``[num_context, 2]`` float: position ``p`` folded row-major into a ``rows × W`` grid, ``(p // W, p % W)``.

    ``W = 2^floor(log2(num_context) / 2)`` (8 × 8 for 64 tokens, 8 × 16 rows × columns for 128): the
    copy task's 1-D positions seen as the two pixel axes of an image, which is what gives the
    paper's image tree designs (split on ``x0``, on ``x1``, on a random projection) a meaning here.
    """
    width = 2 ** (int(math.log2(num_context)) // 2)
    pos = torch.arange(num_context)
    return torch.stack([pos // width, pos % width], dim=-1).float()


def tree_key(design: str, batch: int, num_context: int, generator: torch.Generator,
             projection: Optional[Tensor] = None) -> Tensor:
    """``[batch, num_context]`` sort key of the context tokens for a tree design of :data:`TREE_DESIGNS`.

    ``position``: the sequence order (the paper's split of sequence data by time; the default).
    ``random``: a fresh random order per sequence (ReTreever-Random). ``kd-x0`` / ``kd-x1``: sorted
    on one axis of :func:`grid_coords` only, the tokens that share it in a random order (a k-d split
    that knows one coordinate: rows, or columns, are resolved, nothing below them). ``kd-rp``: sorted
    on ``w·(x0, x1)`` for the fixed random ``projection`` ``w`` (ReTreever-KD-RP), a full order unlike
    the sequence's.
    """
    if design == "position":
        return torch.arange(num_context).float().expand(batch, num_context)
    noise = torch.rand(batch, num_context, generator=generator)
    if design == "random":
        return noise
    coords = grid_coords(num_context)
    if design in ("kd-x0", "kd-x1"):
        # Coordinates are integers: adding noise in [0, 1) breaks ties randomly without reordering axes.
        return coords[:, 0 if design == "kd-x0" else 1] + noise
    if design == "kd-rp":
        if projection is None or projection.shape != (2,):
            raise ValueError(f"copy task: tree design 'kd-rp' needs a projection of shape (2,), got {projection}")
        return (coords @ projection).expand(batch, num_context)
    raise ValueError(f"copy task: tree design must be one of {', '.join(TREE_DESIGNS)}, got {design!r}")


def _mlp(d_in: int, dim: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, dim), nn.ReLU(), nn.Linear(dim, dim))


class _Embeddings(nn.Module):
    """Context tokens ``embed(token) + MLP(features(position))``, queries ``MLP'(features(position))``."""

    def __init__(self, seq_len: int, dim: int) -> None:
        super().__init__()
        self.seq_len = seq_len
        n_feat = position_features(torch.zeros(1), seq_len).shape[-1]
        self.token = nn.Embedding(VOCAB, dim)
        self.context_pos, self.query_pos = _mlp(n_feat, dim), _mlp(n_feat, dim)

    def forward(self, context: Tensor, query_pos: Tensor):
        B, c = context.shape
        ctx = self.token(context) + self.context_pos(position_features(torch.arange(c), self.seq_len))
        return ctx, self.query_pos(position_features(query_pos, self.seq_len)).expand(B, -1, -1)


def _classifier(dim: int) -> nn.Sequential:
    return nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, VOCAB))


class CopyModel(nn.Module):
    """Embeddings, one TreeCrossAttention and a classifier (kinds ``tca`` and ``ca``).

    ``tree_design`` chooses the leaves' order (:func:`tree_key`); ``kd-rp`` draws its projection
    ``w ~ N(0, I_2)`` once, from the model's seed, and keeps it fixed.
    """

    def __init__(self, seq_len: int, dim: int, heads: int, branching: int, tree_design: str = "position") -> None:
        super().__init__()
        if tree_design not in TREE_DESIGNS:
            raise ValueError(f"copy task: tree design must be one of {', '.join(TREE_DESIGNS)}, got {tree_design!r}")
        self.seq_len, self.tree_design = seq_len, tree_design
        self.embed = _Embeddings(seq_len, dim)
        self.attention = TreeCrossAttention(dim, heads, branching=branching)
        self.classifier = _classifier(dim)
        self.register_buffer("projection", torch.randn(2))

    def encode(self, context: Tensor, query_pos: Tensor, generator: Optional[torch.Generator] = None):
        """``(tree state of the context, query embeddings [B, N_q, dim])``."""
        ctx, query = self.embed(context, query_pos)
        key = tree_key(self.tree_design, *context.shape, generator or torch.Generator().manual_seed(0),
                       self.projection)
        return self.attention.build(ctx, key), query


class PerceiverCopyModel(nn.Module):
    """Perceiver IO on the copy task: ``num_latents`` latents read the context, the queries read the latents.

    Each of ``layers`` iterative blocks is a pre-norm cross attention of the latents over the
    context and a pre-norm self attention of the latents (attn_ext's
    :class:`~attn_ext.nn.PreNormBlock`); each query reads the final latents by one
    :class:`~attn_ext.nn.MultiheadCrossAttention`, so it reads ``num_latents`` tokens.
    """

    def __init__(self, seq_len: int, dim: int, heads: int, num_latents: int, layers: int = 1) -> None:
        super().__init__()
        self.num_latents = num_latents
        self.embed = _Embeddings(seq_len, dim)
        self.latents = learned_latents(num_latents, dim)
        self.read_context = nn.ModuleList(PreNormBlock(dim, heads, 2 * dim, cross=True) for _ in range(layers))
        self.mix_latents = nn.ModuleList(PreNormBlock(dim, heads, 2 * dim, cross=False) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.read_out = MultiheadCrossAttention(dim, heads)
        self.classifier = _classifier(dim)

    def forward(self, context: Tensor, query_pos: Tensor) -> Tensor:
        """``[B, N_q, VOCAB]`` logits."""
        ctx, query = self.embed(context, query_pos)
        latents = self.latents.expand(ctx.shape[0], -1, -1)
        for read, mix in zip(self.read_context, self.mix_latents):
            latents = mix(read(latents, ctx))
        latents = self.norm(latents)
        return self.classifier(self.read_out(query, latents, latents)[0])
