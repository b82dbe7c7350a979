"""Test matrices of the batched Cholesky and SPD-solve tests, and their accuracy rule."""
import math

import torch


def spd(batch_shape, n, dtype=torch.float64, seed=0):
    """Z Zᵀ / n + I: symmetric positive definite with a condition number of order 10."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(*batch_shape, n, n, generator=g, dtype=torch.float64)
    return (z @ z.mT / n + torch.eye(n, dtype=torch.float64)).to(dtype)


def ill_conditioned(batch_shape, n, condition, dtype, seed=0):
    """Q diag(eigenvalues from 1 down to 1/condition) Qᵀ with a random orthogonal Q."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(*batch_shape, n, n, generator=g, dtype=torch.float64))
    eigenvalues = torch.logspace(0, -math.log10(condition), n, dtype=torch.float64)
    return ((q * eigenvalues) @ q.mT).to(dtype)


def indefinite_at(n, j, seed=0):
    """M D Mᵀ with M unit lower triangular and D = diag(1, …, −1 at column j, …): the pivots are D's,
    so a Cholesky factorisation must stop at column j, with no rounding ambiguity. M's entries shrink
    with n because random triangular matrices are otherwise exponentially ill-conditioned."""
    g = torch.Generator().manual_seed(seed)
    entries = (torch.rand(n, n, generator=g, dtype=torch.float64) - 0.5) * (2 / math.sqrt(n))
    m = torch.tril(entries, diagonal=-1) + torch.eye(n, dtype=torch.float64)
    d = torch.ones(n, dtype=torch.float64)
    d[j] = -1.0
    return (m * d) @ m.mT


def rhs(batch_shape, n, r, dtype, seed=1):
    return torch.randn(*batch_shape, n, r, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def assert_as_accurate_as_torch(ours, torch_same_precision, truth, what, floor_ulps=4):
    """max|ours − truth| ≤ 2·max|torch − truth| + floor_ulps ulps of the data."""
    eps = torch.finfo(ours.dtype).eps
    ours_err = (ours.double() - truth).abs().max().item() if ours.numel() else 0.0
    torch_err = (torch_same_precision.double() - truth).abs().max().item() if ours.numel() else 0.0
    floor = floor_ulps * eps * (truth.abs().max().item() if truth.numel() else 0.0)
    assert ours_err <= 2 * torch_err + floor, f"{what}: error {ours_err:.3g} vs torch's {torch_err:.3g} (floor {floor:.3g})"
