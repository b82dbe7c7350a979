"""Intention (SPEC §4): ``Q (KᵀK + αI)⁻¹ KᵀV``, least-squares attention.

So far this package holds its linear-algebra foundation: batched Cholesky factorisation and solves of
the small SPD matrices ``KᵀK + αI`` (one per batch and head), as compiled CPU kernels.

>>> import torch
>>> from attn_ext.intention import batched_cholesky, batched_cholesky_solve
>>> K = torch.randn(8, 100, 16, dtype=torch.float64)
>>> A = K.mT @ K + 0.1 * torch.eye(16, dtype=torch.float64)
>>> L, info = batched_cholesky(A)
>>> bool((info == 0).all())
True
>>> X = batched_cholesky_solve(L, K.mT @ K)
>>> torch.allclose(A @ X, K.mT @ K)
True
"""
from attn_ext.intention.cholesky import batched_cholesky, batched_cholesky_solve

__all__ = ["batched_cholesky", "batched_cholesky_solve"]
