"""LBANP-ND (Feng et al. 2023): LBANP's latents and query decoder with a joint Gaussian over all targets,
given by a Cholesky factor of its full covariance (:mod:`attn_ext.models.not_diagonal`)."""
from __future__ import annotations

from typing import Optional

from attn_ext.models.base import NPConfig
from attn_ext.models.lbanp import LBANP
from attn_ext.models.not_diagonal import ND_DEFAULTS, NotDiagonalNP


class LBANPND(NotDiagonalNP, LBANP):
    """Latent Bottlenecked Attentive Neural Process, Not-Diagonal.

    The context is summarised into ``num_latents`` latents and the targets read them as in
    :class:`~attn_ext.models.LBANP` (memory linear in ``N_c``); the decoded target features go through
    :class:`~attn_ext.models.not_diagonal.NotDiagonalHead`, the same head as
    :class:`~attn_ext.models.TNPND`'s: a mean per target and the Cholesky factor of the covariance
    over all ``N_t · dim_y`` outputs (memory quadratic in ``N_t · dim_y``). The methods are TNPND's:
    :meth:`predict` gives the joint ``MultivariateNormal``, :meth:`marginals` the per-target ``Normal``,
    :meth:`forward` and :meth:`log_likelihood` the joint (negative) log-likelihood divided by ``N_t``.

    Parameters
    ----------
    config : NPConfig, optional
        Sizes (the official LBANP GP configuration by default); keyword overrides on top.
    block : {"prenorm", "perceiver", "official"}
        LBANP's attention blocks (see :class:`~attn_ext.models.LBANP`); the covariance head's target
        self attention is pre-norm whatever this is.
    num_std_layers, prj_dim, prj_depth : int
        The covariance head's sizes; defaults 2, 20, 4: the official LBANP-ND configuration.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.models import LBANPND
    >>> model = LBANPND(num_layers=2, num_latents=8, dim_y=2)
    >>> xc, yc, xt = torch.randn(2, 10, 1), torch.randn(2, 10, 2), torch.randn(2, 7, 1)
    >>> joint = model.predict(xc, yc, xt)
    >>> joint.loc.shape, joint.scale_tril.shape
    (torch.Size([2, 14]), torch.Size([2, 14, 14]))
    >>> model.marginals(xc, yc, xt).scale.shape
    torch.Size([2, 7, 2])
    """

    def __init__(self, config: Optional[NPConfig] = None, *, block: str = "prenorm",
                 num_std_layers: int = ND_DEFAULTS["num_std_layers"], prj_dim: int = ND_DEFAULTS["prj_dim"],
                 prj_depth: int = ND_DEFAULTS["prj_depth"], **overrides) -> None:
        super().__init__(config, block=block, **overrides)
        # LBANP built a diagonal head; the joint one replaces it (LBANP.predict ends in self.head).
        self.use_not_diagonal_head(num_std_layers=num_std_layers, prj_dim=prj_dim, prj_depth=prj_depth)
