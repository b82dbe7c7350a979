"""CMANP-AND (Feng et al., §3.3, App. C.2, E.1; docs/spec.md §2): CMANP with a full covariance over the
targets (low-rank, or Cholesky as TNP-ND's), deployed block-autoregressively with the constant-memory update."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn
from torch.distributions import LowRankMultivariateNormal, MultivariateNormal, Normal

from attn_ext.data.batch import PackedNPBatch
from attn_ext.models.base import NPConfig, check_points
from attn_ext.models.cmanp import CMANP, CMANPState
from attn_ext.models.lowrank_normal import TaskwiseLowRankNormal
from attn_ext.models.not_diagonal import NotDiagonalHead, check_targets, marginal_normal, refuse_packed, sample_joint
from attn_ext.models.packed import per_task
from attn_ext.nn.layer_norm import LayerNorm
from attn_ext.ops.utils.validation import is_int_scalar

#: ``covariance`` choices: name -> how a block's joint covariance is parameterised.
COVARIANCES = ("lowrank", "cholesky")


class _LowRankHead(nn.Module):
    """Per target: mean, log-std of the diagonal and ``rank`` covariance factors, per y dimension."""

    def __init__(self, d_model: int, ff_dim: int, dim_y: int, rank: int) -> None:
        super().__init__()
        self.dim_y, self.rank = dim_y, rank
        self.net = nn.Sequential(LayerNorm(d_model), nn.Linear(d_model, ff_dim), nn.ReLU(),
                                 nn.Linear(ff_dim, (2 + rank) * dim_y))

    def forward(self, h: Tensor) -> LowRankMultivariateNormal:
        """Joint Gaussian over the flattened ``[B, N_t · dim_y]`` targets; a task whose features are not
        finite gets a NaN joint, the others are unaffected (:class:`TaskwiseLowRankNormal`)."""
        B, M, _ = h.shape
        out = self.net(h).view(B, M, self.dim_y, 2 + self.rank)
        loc, raw_std, factor = out[..., 0], out[..., 1], out[..., 2:] / self.rank ** 0.5
        return TaskwiseLowRankNormal(loc.reshape(B, -1), factor.reshape(B, M * self.dim_y, self.rank),
                                     torch.exp(2 * raw_std).reshape(B, -1), "CMANPAND")


class CMANPAND(CMANP):
    """CMANP with an Autoregressive Not-Diagonal predictive (CMANP-AND).

    Training (:meth:`forward`) maximises the joint Gaussian likelihood of all targets (the
    Not-Diagonal framework) under a low-rank-plus-diagonal covariance (``covariance="lowrank"``) or a
    full covariance given by its Cholesky factor (``"cholesky"``, the head of
    :class:`~attn_ext.models.TNPND`, which the CMANP paper's App. E.1 uses for its AND experiments).
    At deployment the targets are
    processed in blocks of ``block_size`` (``b_Q``): :meth:`sample` draws a block from its joint
    Gaussian, adds the samples to the context with :meth:`update` and moves on;
    :meth:`log_likelihood` scores the true targets the same way, conditioning each block on the true
    earlier ones (CMANP App. C.2: ``log p = Σ_k log N(Y_k | μ(D_C^k, X_k), Σ(D_C^k, X_k))``), and
    returns it per target. Memory is constant in ``N_c`` and linear in ``N_t`` (the Cholesky
    covariance of a block is ``[B, b_Q·dim_y, b_Q·dim_y]``; training's joint over all targets is quadratic).

    Parameters
    ----------
    config : NPConfig, optional
    block_size : int
        ``b_Q`` (paper: 5).
    rank : int
        Rank of the low-rank covariance factor (at least ``block_size`` so that a block's covariance
        is full); unused with ``covariance="cholesky"``.
    covariance : {"lowrank", "cholesky"}
        ``"lowrank"`` (default): ``Σ = F Fᵀ + diag(d)`` from per-target factors;
        ``"cholesky"``: ``Σ = L Lᵀ`` from :class:`~attn_ext.models.not_diagonal.NotDiagonalHead`
        (the official TNP-ND sizes: 2 target self-attention layers, ``prj_dim`` 20, projector depth 4).

    Examples
    --------
    >>> import torch
    >>> from attn_ext.models import CMANPAND
    >>> from attn_ext.data import GPSampler
    >>> model = CMANPAND(num_layers=2, num_latents=8, block_size=3).eval()
    >>> batch = GPSampler().sample(2, generator=torch.Generator().manual_seed(0))
    >>> model.log_likelihood(batch).shape
    torch.Size([2])
    >>> model.sample(batch.xc, batch.yc, batch.xt, generator=torch.Generator().manual_seed(1)).shape == batch.yt.shape
    True
    >>> chol = CMANPAND(num_layers=2, num_latents=8, covariance="cholesky").eval()
    >>> chol.joint(chol.condition(batch.xc, batch.yc), batch.xt[:, :5]).scale_tril.shape
    torch.Size([2, 5, 5])
    >>> chol.options()
    {'block': 'prenorm', 'covariance': 'cholesky'}
    """

    def __init__(self, config: Optional[NPConfig] = None, *, block_size: int = 5, rank: int = 16,
                 covariance: str = "lowrank", **overrides) -> None:
        if block_size <= 0 or rank <= 0:
            raise ValueError(f"CMANPAND: block_size and rank must be positive, got {block_size}, {rank}")
        if covariance not in COVARIANCES:
            raise ValueError(f"CMANPAND: unknown covariance {covariance!r}; choose one of {', '.join(COVARIANCES)}")
        # Set before CMANP.__init__, which calls make_head.
        self.rank, self.covariance = rank, covariance
        super().__init__(config, **overrides)
        self.block_size = block_size

    def options(self) -> dict:
        """``block`` and ``covariance`` (what ``python -m bench train gp --block/--covariance`` set)."""
        return {**super().options(), "covariance": self.covariance}

    def make_head(self) -> nn.Module:
        c = self.config
        if self.covariance == "cholesky":
            return NotDiagonalHead(c.d_model, c.ff_dim, c.num_heads, c.dim_y)
        return _LowRankHead(c.d_model, c.ff_dim, c.dim_y, self.rank)

    def joint(self, state: CMANPState, xt: Tensor) -> LowRankMultivariateNormal | MultivariateNormal:
        """Joint Gaussian over the flattened targets ``[B, N_t · dim_y]`` given ``state``: low-rank, or
        with ``scale_tril [B, N_t · dim_y, N_t · dim_y]`` under ``covariance="cholesky"``."""
        check_points(self, xt=xt)
        check_targets(self, xt)
        return self.head(self.decode(state, xt))

    def predict_packed(self, xc: Tensor, yc: Tensor, xt: Tensor, cu_seqlens_c: Tensor, cu_seqlens_t: Tensor):
        refuse_packed(self)

    def query(self, state: CMANPState, xt: Tensor) -> Normal:
        """Marginal ``Normal`` per target (the diagonal of the joint covariance)."""
        return marginal_normal(self.joint(state, xt), (*xt.shape[:2], self.config.dim_y))

    def forward(self, batch) -> Tensor:
        """Joint negative log-likelihood of all targets, divided by ``N_t`` (per target), batch mean (a packed batch:
        the mean over its tasks, each alone)."""
        if isinstance(batch, PackedNPBatch):
            return per_task(self, batch, self.forward).mean()
        check_points(self, xc=batch.xc, yc=batch.yc, xt=batch.xt, yt=batch.yt)
        joint = self.joint(self.condition(batch.xc, batch.yc), batch.xt)
        return -(joint.log_prob(batch.yt.flatten(1)) / batch.xt.shape[1]).mean()

    def _blocks(self, xt: Tensor, block_size: Optional[int]):
        b = self.block_size if block_size is None else block_size
        if not is_int_scalar(b) or b <= 0:
            raise ValueError(f"CMANPAND: block_size must be a positive int, got {block_size!r}")
        b = int(b)
        check_targets(self, xt)
        return [(s, min(s + b, xt.shape[1])) for s in range(0, xt.shape[1], b)]

    @torch.no_grad()
    def log_likelihood(self, batch, block_size: Optional[int] = None) -> Tensor:
        """``[B]`` block-autoregressive log-likelihood per target, conditioning on true earlier blocks (a packed
        batch's tasks each alone)."""
        if isinstance(batch, PackedNPBatch):
            return per_task(self, batch, lambda task: self.log_likelihood(task, block_size))
        check_points(self, xc=batch.xc, yc=batch.yc, xt=batch.xt, yt=batch.yt)
        state = self.condition(batch.xc, batch.yc)
        total = batch.yt.new_zeros(batch.yt.shape[0])
        for start, end in self._blocks(batch.xt, block_size):
            x, y = batch.xt[:, start:end], batch.yt[:, start:end]
            total = total + self.joint(state, x).log_prob(y.flatten(1))
            state = self.update(state, x, y)
        return total / batch.xt.shape[1]

    @torch.no_grad()
    def sample(self, xc: Tensor, yc: Tensor, xt: Tensor, block_size: Optional[int] = None,
               generator: Optional[torch.Generator] = None) -> Tensor:
        """One block-autoregressive sample ``[B, N_t, dim_y]`` of the targets."""
        check_points(self, xc=xc, yc=yc, xt=xt)
        state, out = self.condition(xc, yc), []
        for start, end in self._blocks(xt, block_size):
            x = xt[:, start:end]
            y = sample_joint(self.joint(state, x), generator).view(*x.shape[:2], self.config.dim_y)
            out.append(y)
            state = self.update(state, x, y)
        return torch.cat(out, dim=1)
