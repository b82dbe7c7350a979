"""Shared pieces of the reference NP models: configuration, embedder, Gaussian head, input checks.

Every model is a :class:`NeuralProcess`: ``forward(batch)`` returns the training loss (mean
negative log-likelihood per target unless the model says otherwise), ``predict(xc, yc, xt)`` the
predictive :class:`torch.distributions.Normal`, ``log_likelihood(batch)`` the evaluation metric of
docs/spec.md §6 (mean over targets of the Gaussian log-likelihood summed over y dimensions).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch
from torch import Tensor, nn
from torch.distributions import Normal

from attn_ext.data.batch import PackedNPBatch
from attn_ext.models.packed import per_task_prediction, task_log_likelihood
from attn_ext.nn.layer_norm import LayerNorm


@dataclass
class NPConfig:
    """Sizes shared by the reference models; the defaults are docs/spec.md §2/§5's (official TNP/LBANP/CMANP).

    Attributes
    ----------
    dim_x, dim_y : int
        Input and output dimensions of the regression tasks.
    d_model : int
        Width of every embedding and attention layer.
    num_layers : int
        Encoder layers (TNP-D, LinearTNP, IntentionNP, ReTreever), latent blocks (LBANP, CMANP).
    num_heads, ff_dim : int
        Attention heads and feed-forward hidden width.
    emb_depth : int
        Linear layers of the ``[x, y]`` embedding MLP.
    num_latents : int
        Latents of LBANP and CMANP(-AND).
    chunk_size : int or None
        Context points per chunk when CMANP(-AND) conditions, updates or removes points (None: its
        default of 1024, which keeps conditioning in constant memory).
    """

    dim_x: int = 1
    dim_y: int = 1
    d_model: int = 64
    num_layers: int = 6
    num_heads: int = 4
    ff_dim: int = 128
    emb_depth: int = 4
    num_latents: int = 128
    chunk_size: Optional[int] = None

    def to_dict(self) -> dict:
        return asdict(self)


def mlp(dim_in: int, dim_hidden: int, dim_out: int, depth: int) -> nn.Sequential:
    """``depth`` Linear layers with ReLU between them (the official ``build_mlp``)."""
    if depth < 1:
        raise ValueError(f"an MLP needs depth >= 1, got {depth}")
    layers = [nn.Linear(dim_in, dim_hidden if depth > 1 else dim_out)]
    for i in range(1, depth):
        layers += [nn.ReLU(), nn.Linear(dim_hidden, dim_hidden if i < depth - 1 else dim_out)]
    return nn.Sequential(*layers)


class GaussianHead(nn.Module):
    """``LN → Linear(d, ff) → ReLU → Linear(ff, 2·dim_y)``; mean and ``std = exp(·)`` (docs/spec.md §2)."""

    def __init__(self, d_model: int, ff_dim: int, dim_y: int) -> None:
        super().__init__()
        self.net = nn.Sequential(LayerNorm(d_model), nn.Linear(d_model, ff_dim), nn.ReLU(),
                                 nn.Linear(ff_dim, 2 * dim_y))

    def forward(self, h: Tensor) -> Normal:
        mean, raw_std = self.net(h).chunk(2, dim=-1)
        # No argument validation: a NaN input must give NaN predictions for the entries it reaches
        # (docs/tree.md, "NaN and infinity"), not a ValueError that discards the whole batch.
        return Normal(mean, torch.exp(raw_std), validate_args=False)


def check_points(model: "NeuralProcess", **tensors: Optional[Tensor]) -> None:
    """Raise ``ValueError`` naming the shapes unless every x is ``[B, N, dim_x]`` and every y is
    ``[B, N, dim_y]`` with one batch size, and each ``(x, y)`` pair has one N."""
    cfg = model.config
    batch = None
    for name, t in tensors.items():
        if t is None:
            continue
        width = cfg.dim_x if name.startswith("x") else cfg.dim_y
        if not isinstance(t, Tensor) or t.dim() != 3 or t.shape[-1] != width:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{type(model).__name__}: {name} must be [B, N, {width}], got {got}")
        if batch is not None and t.shape[0] != batch:
            raise ValueError(f"{type(model).__name__}: batch sizes differ: "
                             + ", ".join(f"{k} {tuple(v.shape)}" for k, v in tensors.items() if v is not None))
        batch = t.shape[0]
    for x_name in ("xc", "xt", "x_new"):
        y_name = "y" + x_name[1:]
        x, y = tensors.get(x_name), tensors.get(y_name)
        if x is not None and y is not None and x.shape[1] != y.shape[1]:
            raise ValueError(f"{type(model).__name__}: {x_name} {tuple(x.shape)} and {y_name} {tuple(y.shape)} "
                             "must have the same number of points")


class NeuralProcess(nn.Module):
    """Base of the reference models: input checks, the NLL loss and the log-likelihood metric.

    Subclasses implement :meth:`predict`; they may override :meth:`forward` (ReTreever's objective)
    and :meth:`log_likelihood` (CMANP-AND's block-autoregressive evaluation).
    """

    def __init__(self, config: Optional[NPConfig] = None, **overrides) -> None:
        super().__init__()
        #: The sizes: ``config`` (default :class:`NPConfig`) with the keyword ``overrides`` applied.
        self.config = NPConfig(**{**(config.to_dict() if config else {}), **overrides})
        c = self.config
        self.embedder = mlp(c.dim_x + c.dim_y, c.d_model, c.d_model, c.emb_depth)
        #: An ``x``-only target embedder, for a model that sets one (else targets go through ``embedder``).
        self.query_embedder: Optional[nn.Module] = None

    def options(self) -> dict:
        """Constructor options beyond :class:`NPConfig` that change the model (none here); checkpoints
        store them so that a run reloads as trained even if a default changes later."""
        return {}

    def embed_pairs(self, x: Tensor, y: Optional[Tensor]) -> Tensor:
        """Embed ``[x, y]`` (targets: ``[x, 0]``, as the official code) to ``[B, N, d_model]``."""
        if y is None:
            y = x.new_zeros(*x.shape[:-1], self.config.dim_y)
        return self.embedder(torch.cat([x, y], dim=-1))

    def embed_targets(self, xt: Tensor) -> Tensor:
        """Target features ``[B, N_t, d_model]``: ``query_embedder(x)`` if the model has one, else ``[x, 0]``."""
        return self.embed_pairs(xt, None) if self.query_embedder is None else self.query_embedder(xt)

    def predict(self, xc: Tensor, yc: Tensor, xt: Tensor) -> Normal:  # pragma: no cover - abstract
        raise NotImplementedError

    def marginals(self, xc: Tensor, yc: Tensor, xt: Tensor) -> Normal:
        """Per-target ``Normal`` (mean and scale ``[B, N_t, dim_y]``): :meth:`predict` itself for the
        diagonal models; the Not-Diagonal ones return their joint prediction's marginals."""
        return self.predict(xc, yc, xt)

    def predict_packed(self, xc: Tensor, yc: Tensor, xt: Tensor, cu_seqlens_c: Tensor, cu_seqlens_t: Tensor) -> Normal:
        """Predictive ``Normal`` over the packed targets ``[T_t, dim_y]`` of a packed batch (the layout of
        :class:`~attn_ext.data.PackedNPBatch`). Here: :meth:`predict` on each task's rows alone, one call per task
        (:func:`~attn_ext.models.packed.per_task_prediction`); the models with a packed attention path (TNPD,
        LBANP, CMANP, TransformerCA, PerceiverIONP) override it with one call per layer."""
        return per_task_prediction(self, xc, yc, xt, cu_seqlens_c, cu_seqlens_t)

    def forward(self, batch) -> Tensor:
        """Mean negative log-likelihood per target of ``batch`` (an ``NPBatch``), a scalar; of a
        :class:`~attn_ext.data.PackedNPBatch`, the mean over tasks of each task's (:mod:`attn_ext.models.packed`)."""
        if isinstance(batch, PackedNPBatch):
            return -task_log_likelihood(self, batch).mean()
        check_points(self, xc=batch.xc, yc=batch.yc, xt=batch.xt, yt=batch.yt)
        return -self.predict(batch.xc, batch.yc, batch.xt).log_prob(batch.yt).sum(-1).mean()

    @torch.no_grad()
    def log_likelihood(self, batch) -> Tensor:
        """``[B]``: per task, the mean over targets of ``log p(y_t)`` summed over y dims (docs/spec.md §6)."""
        if isinstance(batch, PackedNPBatch):
            return task_log_likelihood(self, batch)
        check_points(self, xc=batch.xc, yc=batch.yc, xt=batch.xt, yt=batch.yt)
        return self.predict(batch.xc, batch.yc, batch.xt).log_prob(batch.yt).sum(-1).mean(-1)
