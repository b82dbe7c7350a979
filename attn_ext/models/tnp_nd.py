"""TNP-ND (Nguyen & Grover 2022): TNP-D's encoder with a joint Gaussian over all targets, given by a
Cholesky factor of its full covariance (:mod:`attn_ext.models.not_diagonal`)."""
from __future__ import annotations

from typing import Optional

from attn_ext.models.base import NPConfig
from attn_ext.models.not_diagonal import ND_DEFAULTS, NotDiagonalNP
from attn_ext.models.tnpd import TNPD


class TNPND(NotDiagonalNP, TNPD):
    """Transformer Neural Process, Not-Diagonal.

    The encoder is :class:`~attn_ext.models.TNPD`'s (targets attend to the context only, on attn_ext's
    fused cross attention); the target features then go through
    :class:`~attn_ext.models.not_diagonal.NotDiagonalHead`: a mean per target, and the Cholesky factor
    ``L = tril(Z Zᵀ, −1) + diag(1e-3 + ‖z_i‖²)`` of the covariance over all ``N_t · dim_y`` outputs,
    with ``z`` from a target self attention and a projector. Memory is quadratic in ``N_t · dim_y``.

    :meth:`predict` returns the joint :class:`torch.distributions.MultivariateNormal`
    (``loc [B, N_t · dim_y]``, flattened as ``yt.flatten(1)``); :meth:`marginals` its per-target
    :class:`~torch.distributions.Normal`; :meth:`forward` the joint negative log-likelihood divided by
    ``N_t``; :meth:`log_likelihood` the joint log-likelihood divided by ``N_t`` per task; :meth:`sample`
    one joint draw.

    Parameters
    ----------
    config : NPConfig, optional
        Sizes of the encoder (the official TNP GP configuration by default); keyword overrides on top.
    num_std_layers, prj_dim, prj_depth : int
        Target self-attention layers of the covariance head, features per output of ``z``, projector
        layers; defaults 2, 20, 4: the official TNP-ND GP configuration.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.models import TNPND
    >>> from attn_ext.data import GPSampler
    >>> model = TNPND(num_layers=2, d_model=32)
    >>> batch = GPSampler().sample(4, generator=torch.Generator().manual_seed(0))
    >>> joint = model.predict(batch.xc, batch.yc, batch.xt)
    >>> n = batch.xt.shape[1]
    >>> joint.loc.shape == (4, n) and joint.scale_tril.shape == (4, n, n)
    True
    >>> bool(torch.isfinite(model(batch))), model.log_likelihood(batch).shape
    (True, torch.Size([4]))
    >>> model.marginals(batch.xc, batch.yc, batch.xt).mean.shape == batch.yt.shape
    True
    """

    def __init__(self, config: Optional[NPConfig] = None, *, num_std_layers: int = ND_DEFAULTS["num_std_layers"],
                 prj_dim: int = ND_DEFAULTS["prj_dim"], prj_depth: int = ND_DEFAULTS["prj_depth"],
                 **overrides) -> None:
        super().__init__(config, **overrides)
        # TNPD built a diagonal head; the joint one replaces it (TNPD.predict ends in self.head).
        self.use_not_diagonal_head(num_std_layers=num_std_layers, prj_dim=prj_dim, prj_depth=prj_depth)
