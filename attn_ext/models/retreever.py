"""ReTreever (Feng et al., Tree Cross Attention §3.4; docs/spec.md §3): a context encoder, then targets read
``O(log N_c)`` tree nodes of the encoded context through Tree Cross Attention."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor
from torch.distributions import Normal

from attn_ext.data.batch import PackedNPBatch
from attn_ext.models.base import GaussianHead, NeuralProcess, NPConfig, check_points
from attn_ext.models.layers import ContextEncoder
from attn_ext.models.packed import per_task
from attn_ext.nn import TreeCrossAttention, tca_loss
from attn_ext.nn.tree_cross_attention import TreeState

#: Tree designs of :class:`ReTreever` (Tree Cross Attention, Table 6).
TREE_DESIGNS = ("kd", "random", "kd-x0", "kd-x1", "kd-rp")


class ReTreever(NeuralProcess):
    """ReTreever for NP regression, trained with the TCA objective of :func:`attn_ext.nn.tca_loss`.

    The context ``[xc, yc]`` is embedded and encoded by a Transformer encoder over the context
    (:class:`attn_ext.models.layers.ContextEncoder`); a tree is built over the encodings ordered by
    ``x``; each target's embedding ``[xt, 0]`` queries the tree (sampled descent in training, greedy
    in evaluation) and the Gaussian head reads ``query + TCA(query)``. ``forward`` returns
    ``L_TCA + λ_CA·L_CA + λ_RL·L_RL`` with the per-target log-likelihood as reward.

    Parameters
    ----------
    config : NPConfig, optional
    branching : int
        Tree branching factor ``b``.
    aggregator : {"transformer", "mean"}
        Node aggregator (:mod:`attn_ext.nn.tree_aggregator`): the paper's self-attention block over the
        children (docs/spec.md §3), or their plain mean.
    backprop_through_tree : bool
        False (the paper's GP setting, ``bptt=False``) detaches the children in the node aggregation:
        the aggregator learns from the internal nodes, the encoder only from the leaves.
    lambda_ca, lambda_rl, alpha : float
        Weights of the objective (paper: 1, 1, 0.01); finite and >= 0.
    tree_design : {"kd", "random", "kd-x0", "kd-x1", "kd-rp"}
        How the context is laid out over the leaves (the paper's tree-design ablation, Table 6):
        ``"kd"`` (default) sorts each context along its coordinate of largest spread (x itself for
        1-D inputs); ``"kd-x0"`` / ``"kd-x1"`` along the first / second input coordinate
        (``"kd-x1"`` needs ``dim_x >= 2``); ``"kd-rp"`` along ``w·x`` for a random ``w ~ N(0, I)``
        drawn at construction and fixed (a buffer, saved with the model); ``"random"`` in a fresh
        random order on every call.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.models import ReTreever
    >>> from attn_ext.data import GPSampler
    >>> model = ReTreever(num_layers=1)
    >>> batch = GPSampler().sample(2, generator=torch.Generator().manual_seed(0))
    >>> bool(torch.isfinite(model(batch)))
    True
    >>> model.eval().predict(batch.xc, batch.yc, batch.xt).mean.shape == batch.yt.shape
    True
    """

    def __init__(self, config: Optional[NPConfig] = None, *, branching: int = 2, aggregator: str = "transformer",
                 backprop_through_tree: bool = False, lambda_ca: float = 1.0, lambda_rl: float = 1.0,
                 alpha: float = 0.01, tree_design: str = "kd", **overrides) -> None:
        super().__init__(config, **overrides)
        c = self.config
        self.lambdas = dict(lambda_ca=lambda_ca, lambda_rl=lambda_rl, alpha=alpha)
        for name, value in self.lambdas.items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"ReTreever: {name} must be a finite number >= 0, got {value!r}")
        if tree_design not in TREE_DESIGNS:
            raise ValueError(f"ReTreever: tree_design must be one of {', '.join(TREE_DESIGNS)}, got {tree_design!r}")
        if tree_design == "kd-x1" and c.dim_x < 2:
            raise ValueError(f"ReTreever: tree_design 'kd-x1' needs dim_x >= 2, got dim_x={c.dim_x}")
        self.tree_design = tree_design
        self._options = dict(aggregator=aggregator, backprop_through_tree=backprop_through_tree)
        # Ablation options are reported only when not at their default, so that checkpoints and
        # reports of runs with the defaults read as before (a missing key means the default).
        defaults = dict(tree_design="kd", lambda_ca=1.0, lambda_rl=1.0, alpha=0.01)
        given = dict(tree_design=tree_design, **self.lambdas)
        self._options.update({k: v for k, v in given.items() if v != defaults[k]})
        self.encoder = ContextEncoder(c.num_layers, c.d_model, c.num_heads, c.ff_dim, "softmax")
        self.tca = TreeCrossAttention(c.d_model, c.num_heads, branching, aggregator, ff_dim=c.ff_dim,
                                      backprop_through_tree=backprop_through_tree)
        self.head = GaussianHead(c.d_model, c.ff_dim, c.dim_y)
        # Drawn after every layer (the layers start from the same weights under every design) and only
        # for kd-rp, so that the default model's state dict and random stream are unchanged.
        self.register_buffer("projection", torch.randn(c.dim_x) if tree_design == "kd-rp" else None)

    def options(self) -> dict:
        """``aggregator`` and ``backprop_through_tree`` (what ``python -m bench train`` can set in the repository's
        harness), and ``tree_design``, ``lambda_ca``, ``lambda_rl``, ``alpha`` where not at their defaults."""
        return dict(self._options)

    def build(self, xc: Tensor, yc: Tensor) -> TreeState:
        """Encode the context and organise it into a tree (once per context)."""
        check_points(self, xc=xc, yc=yc)
        if xc.shape[1] == 0:  # a tree needs a leaf; say so in the model's words, not build_tree's
            raise ValueError(f"ReTreever: the context must have at least one point, got xc {tuple(xc.shape)}")
        context = self.encoder(self.embed_pairs(xc, yc), xc.shape[1])
        key = self.tree_key(xc)
        # A task with a non-finite sort key has no tree order (build_tree would refuse the whole batch):
        # it is built over a stand-in key and its context is NaN, so that its predictions are NaN and
        # the other tasks are computed as without it (docs/models.md: NaN only where it reaches).
        finite = torch.isfinite(key.flatten(1)).all(1)
        task = (-1,) + (1,) * (key.dim() - 1)
        key = torch.where(finite.view(task), key, torch.zeros((), dtype=key.dtype, device=key.device))
        context = torch.where(finite.view(-1, 1, 1), context,
                              torch.full((), float("nan"), dtype=context.dtype, device=context.device))
        return self.tca.build(context, key)

    def tree_key(self, xc: Tensor) -> Tensor:
        """What the tree sorts the context by under :attr:`tree_design`: ``xc`` itself for ``"kd"`` (the
        coordinate of largest spread is chosen per context), else a ``[B, N_c]`` key."""
        if self.tree_design == "kd":
            return xc
        if self.tree_design == "random":
            return torch.rand(xc.shape[:2], device=xc.device)
        if self.tree_design == "kd-rp":
            return xc @ self.projection.to(xc.dtype)
        return xc[..., 0 if self.tree_design == "kd-x0" else 1]

    def predict(self, xc: Tensor, yc: Tensor, xt: Tensor, policy: Optional[str] = None) -> Normal:
        """Predictive ``Normal`` at ``xt``; ``policy`` as :meth:`TreeCrossAttention.forward`
        (greedy in eval mode, ``"full"`` attends over every leaf)."""
        check_points(self, xc=xc, yc=yc, xt=xt)
        query = self.embed_pairs(xt, None)
        return self.head(query + self.tca(query, self.build(xc, yc), policy=policy).out)

    def forward(self, batch) -> Tensor:
        """``L_TCA + λ_CA·L_CA + λ_RL·L_RL`` (per-target NLLs, REINFORCE with the log-likelihood reward); of a
        :class:`~attn_ext.data.PackedNPBatch`, the mean over its tasks of each task's objective (one tree per task,
        as the packed loss of the other models weighs each task alike)."""
        if isinstance(batch, PackedNPBatch):
            return per_task(self, batch, self.forward).mean()
        check_points(self, xc=batch.xc, yc=batch.yc, xt=batch.xt, yt=batch.yt)
        tree = self.build(batch.xc, batch.yc)
        query = self.embed_pairs(batch.xt, None)
        res = self.tca(query, tree)
        ll_tca = self.head(query + res.out).log_prob(batch.yt).sum(-1)
        ll_ca = self.head(query + self.tca.forward_full(query, tree)).log_prob(batch.yt).sum(-1)
        # A mean baseline keeps REINFORCE's variance down without biasing the gradient.
        reward = ll_tca - ll_tca.mean()
        return tca_loss(-ll_tca.mean(), -ll_ca.mean(), reward, res.log_prob, res.entropy, **self.lambdas)
