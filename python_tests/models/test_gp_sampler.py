"""attn_ext.data.GPSampler against docs/spec.md §6: counts, ranges, kernels, and the covariance of y."""
import math

import pytest
import torch

from attn_ext.data import GPSampler, NPBatch
from attn_ext.data.gp import kernel_matrix


def test_counts_ranges_and_shared_shapes():
    sampler, gen = GPSampler("rbf"), torch.Generator().manual_seed(0)
    counts = [sampler.sample_counts(gen) for _ in range(4000)]
    ncs, nts = [c for c, _ in counts], [t for _, t in counts]
    assert min(ncs) == 3 and max(ncs) == 46
    assert min(nts) == 3 and all(3 <= t <= 49 - c for c, t in counts)
    assert max(c + t for c, t in counts) == 49
    batch = sampler.sample(8, generator=gen)
    assert isinstance(batch, NPBatch)
    assert batch.xc.shape[:2] == batch.yc.shape[:2] and batch.xt.shape[:2] == batch.yt.shape[:2]
    assert batch.xc.shape[0] == 8 and batch.xc.shape[-1] == 1 and batch.yt.shape[-1] == 1
    x = torch.cat([torch.cat([b.xc, b.xt], 1).flatten() for b in (sampler.sample(16, gen) for _ in range(20))])
    assert x.min() >= -2 and x.max() < 2 and x.min() < -1.9 and x.max() > 1.9


def test_seeded_and_length_ranges():
    a = GPSampler().sample(4, generator=torch.Generator().manual_seed(3))
    b = GPSampler().sample(4, generator=torch.Generator().manual_seed(3))
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert GPSampler(length_range="paper").length_range == (0.6, 1.0)
    assert GPSampler().length_range == (0.1, 0.6)
    with pytest.raises(ValueError, match="kernel"):
        GPSampler("cosine")
    with pytest.raises(ValueError, match="length_range"):
        GPSampler(length_range="book")


def test_kernel_formulas():
    x = torch.tensor([[[0.0], [0.5]]], dtype=torch.float64)
    one, half = torch.ones(1, dtype=torch.float64), torch.full((1,), 0.5, dtype=torch.float64)
    rbf = kernel_matrix("rbf", x, half, 2 * one)
    assert rbf[0, 0, 1].item() == pytest.approx(4 * math.exp(-0.5))
    matern = kernel_matrix("matern52", x, half, one)
    s5 = math.sqrt(5)
    assert matern[0, 0, 1].item() == pytest.approx((1 + s5 + 5 / 3) * math.exp(-s5))
    periodic = kernel_matrix("periodic", x, one, one, period=torch.full((1,), 0.3, dtype=torch.float64))
    assert periodic[0, 0, 1].item() == pytest.approx(math.exp(-2 * math.sin(math.pi * 0.5 / 0.3) ** 2))
    assert torch.allclose(torch.diagonal(rbf, dim1=-2, dim2=-1), torch.full((1, 2), 4.0, dtype=torch.float64))


@pytest.mark.parametrize("kernel", ["rbf", "matern52", "periodic"])
def test_y_covariance_is_the_kernel_plus_noise(kernel):
    # Pin the hyper-parameters so each draw's covariance is known from its x; whitening y with it
    # must give standard normal vectors (empirical covariance ≈ I).
    length, scale, period = 0.4, 0.7, 0.3
    sampler = GPSampler(kernel, length_range=(length, length), scale_range=(scale, scale),
                        period_range=(period, period))
    batch = sampler.sample(4000, generator=torch.Generator().manual_seed(1), num_context=4, num_target=4,
                           dtype=torch.float64)
    x, y = torch.cat([batch.xc, batch.xt], 1), torch.cat([batch.yc, batch.yt], 1)
    B = x.shape[0]
    p = torch.full((B,), period, dtype=torch.float64)
    cov = kernel_matrix(kernel, x, torch.full((B,), length, dtype=torch.float64),
                        torch.full((B,), scale, dtype=torch.float64), p) + 0.02 ** 2 * torch.eye(8, dtype=torch.float64)
    z = torch.linalg.solve_triangular(torch.linalg.cholesky(cov), y, upper=False).squeeze(-1)
    emp = z.T @ z / B
    assert torch.allclose(emp, torch.eye(8, dtype=torch.float64), atol=0.12), emp
    # Marginal variance: scale² + noise².
    assert (y.pow(2).mean().item()) == pytest.approx(scale ** 2 + 0.02 ** 2, rel=0.1)
