"""The Not-Diagonal (ND) predictive of TNP-ND, LBANP-ND and CMANP-AND's ``covariance="cholesky"``.

A Not-Diagonal Neural Process predicts one joint Gaussian over all its targets: a mean per target and
y dimension, and a full covariance over the ``n = N_t · dim_y`` flattened outputs (target-major:
entry ``t · dim_y + d`` is target ``t``'s y dimension ``d``, as ``yt.flatten(1)``), given through its
lower-triangular Cholesky factor ``L`` (``Σ = L Lᵀ``). The head follows the official TNP-ND code
(Nguyen & Grover 2022, "cholesky" option):

1. ``mean = MLP(h)`` per target (LayerNorm → Linear → ReLU → Linear, as the diagonal head's mean);
2. ``h' = SelfAttention^{num_std_layers}(h)``: the targets attend to each other (pre-norm blocks on
   attn_ext's attention, a final LayerNorm), so that each target's covariance features know the others;
3. ``z = MLP_{prj_depth}(h')``, ``prj_dim · dim_y`` features per target, read as one vector
   ``z_i ∈ R^{prj_dim}`` per flattened output ``i`` (``Z [B, n, prj_dim]``);
4. ``L = tril(Z Zᵀ, −1) + diag(min_diag + ‖z_i‖²)``.

Step 4 is the official ``tril(Z Zᵀ)`` (its diagonal is ``‖z_i‖²``) plus a floor ``min_diag``
(:data:`MIN_DIAG`): a lower-triangular matrix with a positive diagonal is a valid Cholesky factor,
so ``Σ`` is positive definite for every ``z``, also for ``n = 1``, and ``log det Σ = 2 Σ log L_ii``
stays finite where the official form can reach ``L_ii = 0`` (``z_i = 0``).
Memory is quadratic in ``N_t · dim_y`` (the ``[B, n, n]`` factor): the reason for CMANP-AND.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn
from torch.distributions import LowRankMultivariateNormal, MultivariateNormal, Normal

from attn_ext.data.batch import PackedNPBatch
from attn_ext.models.base import check_points, mlp
from attn_ext.models.packed import per_task
from attn_ext.nn import PreNormBlock
from attn_ext.nn.layer_norm import LayerNorm
from attn_ext.ops.utils.validation import is_int_scalar

#: Floor added to the Cholesky diagonal ``‖z_i‖²``: keeps ``Σ`` positive definite and its log
#: determinant finite; small next to the GP tasks' 0.02 observation noise std, so it does not bound the fit.
MIN_DIAG = 1e-3

#: The official TNP-ND / LBANP-ND GP configuration of the covariance head (both repositories' ``gp``
#: and image configs): 2 target self-attention layers, 20 projection features, a 4-layer projector.
ND_DEFAULTS = {"num_std_layers": 2, "prj_dim": 20, "prj_depth": 4}


def cholesky_from_projections(z: Tensor, min_diag: float = MIN_DIAG) -> Tensor:
    """``L = tril(Z Zᵀ, −1) + diag(min_diag + ‖z_i‖²)`` for ``z [..., n, p]``: ``[..., n, n]``,
    lower triangular with a diagonal of at least ``min_diag``."""
    off_diagonal = (z @ z.transpose(-1, -2)).tril(-1)
    return off_diagonal + torch.diag_embed(min_diag + z.pow(2).sum(-1))


def check_nd_options(owner: str, num_std_layers, prj_dim, prj_depth) -> None:
    """``ValueError`` naming ``owner`` unless the head's sizes are ints (``num_std_layers >= 0``, others ``>= 1``)."""
    for name, value, least in (("num_std_layers", num_std_layers, 0), ("prj_dim", prj_dim, 1),
                               ("prj_depth", prj_depth, 1)):
        if not is_int_scalar(value) or value < least:
            raise ValueError(f"{owner}: {name} must be an int >= {least}, got {value!r}")


def check_targets(model: nn.Module, xt: Tensor) -> None:
    """A joint over no targets has no density: ``ValueError`` naming ``xt``'s shape if ``N_t = 0``."""
    if xt.shape[1] == 0:
        raise ValueError(f"{type(model).__name__}: a Not-Diagonal prediction needs at least one target, "
                         f"got xt {tuple(xt.shape)}")


class NotDiagonalHead(nn.Module):
    """Mean and Cholesky factor of the joint Gaussian over all targets (see the module docstring).

    Parameters
    ----------
    d_model, ff_dim, num_heads : int
        Width of the target features, hidden width of the MLPs and blocks, attention heads.
    dim_y : int
        Output dimensions per target.
    num_std_layers, prj_dim, prj_depth : int
        Target self-attention layers, ``z`` features per output, projector layers (:data:`ND_DEFAULTS`).

    Examples
    --------
    >>> import torch
    >>> head = NotDiagonalHead(d_model=16, ff_dim=32, num_heads=2, dim_y=2)
    >>> joint = head(torch.randn(3, 5, 16))
    >>> joint.loc.shape, joint.scale_tril.shape
    (torch.Size([3, 10]), torch.Size([3, 10, 10]))
    """

    def __init__(self, d_model: int, ff_dim: int, num_heads: int, dim_y: int, *,
                 num_std_layers: int = ND_DEFAULTS["num_std_layers"], prj_dim: int = ND_DEFAULTS["prj_dim"],
                 prj_depth: int = ND_DEFAULTS["prj_depth"]) -> None:
        super().__init__()
        check_nd_options(type(self).__name__, num_std_layers, prj_dim, prj_depth)
        self.dim_y, self.prj_dim = dim_y, prj_dim
        self.num_std_layers, self.prj_depth = num_std_layers, prj_depth
        self.mean_net = nn.Sequential(LayerNorm(d_model), nn.Linear(d_model, ff_dim), nn.ReLU(),
                                      nn.Linear(ff_dim, dim_y))
        self.std_encoder = nn.ModuleList(PreNormBlock(d_model, num_heads, ff_dim, cross=False)
                                         for _ in range(num_std_layers))
        self.std_norm = LayerNorm(d_model)
        self.projector = mlp(d_model, ff_dim, prj_dim * dim_y, prj_depth)

    def options(self) -> dict:
        """The head's sizes, as the model constructors take them."""
        return {"num_std_layers": self.num_std_layers, "prj_dim": self.prj_dim, "prj_depth": self.prj_depth}

    def projections(self, h: Tensor) -> Tensor:
        """``Z [B, N_t · dim_y, prj_dim]`` from the target features ``h [B, N_t, d_model]``."""
        for block in self.std_encoder:
            h = block(h)
        z = self.projector(self.std_norm(h))
        return z.view(h.shape[0], h.shape[1] * self.dim_y, self.prj_dim)

    def forward(self, h: Tensor) -> MultivariateNormal:
        """Joint Gaussian over the flattened targets: ``loc [B, N_t · dim_y]``, ``scale_tril [B, n, n]``."""
        loc = self.mean_net(h).flatten(1)
        # No argument validation: NaN features must give NaN predictions, as the diagonal head's do.
        return MultivariateNormal(loc, scale_tril=cholesky_from_projections(self.projections(h)),
                                  validate_args=False)


def marginal_normal(joint, shape) -> Normal:
    """Per-output ``Normal`` of a joint Gaussian (``MultivariateNormal`` or its low-rank form): the mean and
    the square root of the covariance's diagonal, viewed as ``shape`` (``[B, N_t, dim_y]``)."""
    return Normal(joint.loc.view(shape), joint.variance.sqrt().view(shape), validate_args=False)


def sample_joint(joint, generator: Optional[torch.Generator] = None) -> Tensor:
    """One draw ``[B, n]`` of ``joint`` from ``generator``; a low-rank joint draws its factor's noise first."""
    loc = joint.loc
    if isinstance(joint, LowRankMultivariateNormal):
        eps_f = torch.randn(*loc.shape[:-1], joint.cov_factor.shape[-1], 1, generator=generator, dtype=loc.dtype,
                            device=loc.device)
        eps_d = torch.randn(loc.shape, generator=generator, dtype=loc.dtype, device=loc.device)
        return loc + (joint.cov_factor @ eps_f).squeeze(-1) + joint.cov_diag.sqrt() * eps_d
    eps = torch.randn(*loc.shape, 1, generator=generator, dtype=loc.dtype, device=loc.device)
    return loc + (joint.scale_tril @ eps).squeeze(-1)


def refuse_packed(model) -> None:
    """``NotImplementedError`` for a joint-covariance model asked for one prediction over a packed batch's targets:
    the joint covariance over a task's targets is formed per task (its ``[N_t·dim_y]²`` factor), which has no packed
    layout; ``forward`` and ``log_likelihood`` take a packed batch one task at a time (``packed.per_task``)."""
    raise NotImplementedError(f"{type(model).__name__}: predict_packed is not supported (the joint covariance over "
                              "each task's targets is formed per task); forward and log_likelihood take a packed "
                              "batch, one task at a time")


class NotDiagonalNP:
    """Mixin for a :class:`~attn_ext.models.NeuralProcess` whose ``predict`` ends in ``self.head``:
    :meth:`use_not_diagonal_head` swaps in a :class:`NotDiagonalHead`, and the loss and metric become
    the joint ones. List it before the model class (``class TNPND(NotDiagonalNP, TNPD)``)."""

    def use_not_diagonal_head(self, **sizes) -> None:
        """Replace ``self.head`` by a :class:`NotDiagonalHead` of ``sizes`` (:data:`ND_DEFAULTS`' keys)."""
        c = self.config
        check_nd_options(type(self).__name__, **{**ND_DEFAULTS, **sizes})
        self.head = NotDiagonalHead(c.d_model, c.ff_dim, c.num_heads, c.dim_y, **sizes)

    def options(self) -> dict:
        """The base model's options and the covariance head's sizes."""
        return {**super().options(), **self.head.options()}

    def predict(self, xc: Tensor, yc: Tensor, xt: Tensor) -> MultivariateNormal:
        """Joint Gaussian over all targets: ``loc [B, N_t · dim_y]``, ``scale_tril [B, N_t · dim_y, N_t · dim_y]``
        (flattened as ``yt.flatten(1)``)."""
        check_points(self, xc=xc, yc=yc, xt=xt)
        check_targets(self, xt)
        return super().predict(xc, yc, xt)

    def predict_packed(self, xc: Tensor, yc: Tensor, xt: Tensor, cu_seqlens_c: Tensor, cu_seqlens_t: Tensor):
        refuse_packed(self)

    def marginals(self, xc: Tensor, yc: Tensor, xt: Tensor) -> Normal:
        """Per-target ``Normal`` (mean and scale ``[B, N_t, dim_y]``): the joint's marginals."""
        return marginal_normal(self.predict(xc, yc, xt), (*xt.shape[:2], self.config.dim_y))

    def forward(self, batch) -> Tensor:
        """Joint negative log-likelihood of all targets divided by ``N_t`` (per target), batch mean (a packed batch:
        the mean over its tasks, each alone)."""
        if isinstance(batch, PackedNPBatch):
            return per_task(self, batch, self.forward).mean()
        check_points(self, xc=batch.xc, yc=batch.yc, xt=batch.xt, yt=batch.yt)
        joint = self.predict(batch.xc, batch.yc, batch.xt)
        return -(joint.log_prob(batch.yt.flatten(1)) / batch.xt.shape[1]).mean()

    @torch.no_grad()
    def log_likelihood(self, batch) -> Tensor:
        """``[B]``: the joint log-likelihood of all targets divided by ``N_t`` (the ND papers' metric); a packed
        batch's tasks each alone."""
        if isinstance(batch, PackedNPBatch):
            return per_task(self, batch, self.log_likelihood)
        check_points(self, xc=batch.xc, yc=batch.yc, xt=batch.xt, yt=batch.yt)
        joint = self.predict(batch.xc, batch.yc, batch.xt)
        return joint.log_prob(batch.yt.flatten(1)) / batch.xt.shape[1]

    @torch.no_grad()
    def sample(self, xc: Tensor, yc: Tensor, xt: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
        """One joint sample ``[B, N_t, dim_y]`` of the targets."""
        joint = self.predict(xc, yc, xt)
        return sample_joint(joint, generator).view(*xt.shape[:2], self.config.dim_y)
