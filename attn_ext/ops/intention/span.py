"""Solves with the statistics ``G = KᵀK``, ``C = KᵀV`` restricted to the span of the keys, for states of few keys.

A state of ``n < D`` keys has ``rank(G) <= n``, and ``C = KᵀV`` lies in the span of the keys, which is
``G``'s range. So in exact arithmetic the ``D − n`` smallest eigenvalues of ``G + αI`` are ``α`` and
their eigenvectors are orthogonal to ``C``: they add nothing to ``(G + αI)⁻¹C``, or to
``pinv(G + αI)C``. In working precision ``G`` and ``C`` are rounded by about ``u·tr(G)`` in those
directions too, which a Cholesky solve divides by ``α`` (see :mod:`.conditioning`). An
eigendecomposition lets them be dropped instead: the solve keeps the ``n`` largest eigenvalues
only, so its error is that of the eigenvectors of the span, about ``u·λmax/σmin²`` (``σmin`` the
keys' smallest nonzero singular value), as for the dual form, which needs the keys themselves.

The gradient is that of :func:`torch.linalg.eigh`: finite while the eigenvalues are distinct; the
dropped ones only enter through their differences with the kept ones, but two exactly equal
eigenvalues (an exactly zero key feature for every key, say) give NaN gradients, as for
:func:`torch.linalg.pinv`.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def span_solve(system: Tensor, rhs: Tensor, count: Tensor, *, atol: float = 0.0,
               rtol: Optional[float] = 0.0) -> Tensor:
    """``U diag(1/λ on the kept eigenvalues, else 0) Uᵀ rhs`` for the eigendecomposition ``U diag(λ) Uᵀ``
    of the symmetric ``system [B, H, D, D]`` (``G + αI``), ``rhs [B, H, D, r]``.

    Kept: the ``count`` largest eigenvalues (``count`` broadcasts to ``[B, H]``; ``count >= D`` keeps all),
    of those only the ones whose magnitude exceeds ``max(atol, rtol·max|λ|)`` (the tolerance of
    :func:`torch.linalg.pinv`; ``rtol=None`` is its default, ``D·eps`` unless ``atol > 0``).
    """
    D = system.shape[-1]
    if rtol is None:
        rtol = 0.0 if atol > 0 else D * torch.finfo(system.dtype).eps
    eigenvalues, vectors = torch.linalg.eigh(system)                           # ascending
    magnitude = eigenvalues.abs()
    cut = torch.clamp_min(rtol * magnitude.amax(-1, keepdim=True), atol)
    rank = torch.arange(D, device=system.device)                               # position among the ascending
    in_span = rank >= (D - count.to(system.device))[..., None]
    kept = in_span & (magnitude > cut)
    # The inverse of a dropped eigenvalue is never formed (not even in the gradient, hence the stand-in 1).
    inverse = torch.where(kept, 1.0 / torch.where(kept, eigenvalues, torch.ones_like(eigenvalues)),
                          torch.zeros_like(eigenvalues))
    return vectors @ (inverse[..., None] * (vectors.transpose(-1, -2) @ rhs))
