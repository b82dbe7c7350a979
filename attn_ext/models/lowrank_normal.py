"""A low-rank-plus-diagonal Gaussian that keeps a non-finite batch entry to that entry (CMANP-AND's head).

``torch.distributions.LowRankMultivariateNormal`` factorises the capacitance ``I + Wᵀ D⁻¹ W`` of every
batch entry with ``torch.linalg.cholesky`` when it is built: one task whose factor or diagonal holds a
NaN or an infinity (a non-finite ``xc``, ``yc`` or ``xt`` reaches all of them) makes that call raise
``torch._C._LinAlgError`` for the whole batch, naming neither the model nor the NaN. Here the
capacitance of such an entry is NaN (so are its log-density, entropy, samples and marginals) and the
other entries are computed exactly as torch computes them. For finite ``W`` and ``D > 0`` the capacitance
is symmetric with eigenvalues of at least 1, so its factorisation fails only on a degenerate diagonal
(``D`` rounding to 0, or an overflow): that raises ``ValueError`` naming the model.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.distributions import Distribution, LowRankMultivariateNormal


def capacitance_tril(cov_factor: Tensor, cov_diag: Tensor, owner: str) -> Tensor:
    """Cholesky factor ``[..., m, m]`` of ``I + Wᵀ D⁻¹ W`` (``W = cov_factor [..., n, m]``, ``D = cov_diag
    [..., n]``), NaN for the batch entries whose ``W`` or ``D`` is not finite."""
    finite = torch.isfinite(cov_factor).flatten(-2).all(-1) & torch.isfinite(cov_diag).all(-1)
    # Stand-ins (W = 0, D = 1: capacitance I) for the non-finite entries, so that the factorisation of
    # the others runs as torch's; their factor is replaced by NaN below.
    w = torch.where(finite[..., None, None], cov_factor, torch.zeros((), dtype=cov_factor.dtype,
                                                                     device=cov_factor.device))
    d = torch.where(finite[..., None], cov_diag, torch.ones((), dtype=cov_diag.dtype, device=cov_diag.device))
    m = w.shape[-1]
    capacitance = (w.mT / d.unsqueeze(-2)) @ w + torch.eye(m, dtype=w.dtype, device=w.device)
    tril, info = torch.linalg.cholesky_ex(capacitance)
    if bool((info != 0).any()):
        entries = torch.nonzero((info != 0).flatten()).flatten().tolist()
        raise ValueError(f"{owner}: the low-rank covariance of batch entries {entries} cannot be factorised although "
                         "finite: a diagonal variance rounds to 0 or the factor overflows "
                         f"(smallest variance {d.min().item():.3g}, largest factor entry {w.abs().max().item():.3g})")
    return torch.where(finite[..., None, None], tril, torch.full((), float("nan"), dtype=tril.dtype,
                                                                  device=tril.device))


class TaskwiseLowRankNormal(LowRankMultivariateNormal):
    """``LowRankMultivariateNormal(loc, cov_factor, cov_diag)`` without argument validation, whose batch
    entries with a non-finite ``cov_factor`` or ``cov_diag`` are NaN (see the module docstring) instead of
    failing the whole batch. ``loc [..., n]``, ``cov_factor [..., n, m]``, ``cov_diag [..., n]`` of one
    batch shape; ``owner`` names the model in the error of a degenerate finite covariance.

    Examples
    --------
    >>> import torch
    >>> factor, diag = torch.randn(3, 4, 2), torch.ones(3, 4)
    >>> factor[1, 0, 0] = float("nan")
    >>> joint = TaskwiseLowRankNormal(torch.zeros(3, 4), factor, diag, "CMANPAND")
    >>> joint.log_prob(torch.zeros(3, 4)).isnan().tolist()
    [False, True, False]
    """

    def __init__(self, loc: Tensor, cov_factor: Tensor, cov_diag: Tensor, owner: str) -> None:
        if cov_factor.shape[:-1] != loc.shape or cov_diag.shape != loc.shape:
            raise ValueError(f"{owner}: loc {tuple(loc.shape)}, cov_factor {tuple(cov_factor.shape)} and cov_diag "
                             f"{tuple(cov_diag.shape)} must be [..., n], [..., n, m] and [..., n]")
        # The attributes LowRankMultivariateNormal.__init__ sets (torch 2.x), with the capacitance
        # factorised per entry: its methods (log_prob, rsample, variance, entropy, expand) read only these.
        self.loc, self.cov_factor, self.cov_diag = loc, cov_factor, cov_diag
        self._unbroadcasted_cov_factor, self._unbroadcasted_cov_diag = cov_factor, cov_diag
        self._capacitance_tril = capacitance_tril(cov_factor, cov_diag, owner)
        Distribution.__init__(self, loc.shape[:-1], loc.shape[-1:], validate_args=False)

    def expand(self, batch_shape, _instance=None):
        # torch's expand builds a bare LowRankMultivariateNormal unless told the class.
        new = self._get_checked_instance(TaskwiseLowRankNormal, _instance)
        return super().expand(batch_shape, _instance=new)
