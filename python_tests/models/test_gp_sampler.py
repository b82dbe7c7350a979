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


# The 1-D stream as the sampler drew it before d-dimensional inputs existed (seed 7, batches of 3 then
# of 2 with fixed counts, then one more number): the cached fixed-seed evaluation sets depend on it.
REFERENCE_1D = {
    "rbf": ((6, 43), [-0.22400817275047302, 0.8371053338050842, -0.598502516746521], -12.661873972509056,
            [-0.0591070909467525, -0.20177004287641018], 0.1454103660924343),
    "matern52": ((6, 43), [-0.274594247341156, 0.8310970664024353, -0.8374144434928894], -15.193424386437982,
                 [-0.0591070909467525, -0.2131418041195658], 0.1454103660924343),
    "periodic": ((6, 43), [1.184313416481018, -0.6003932356834412, 0.0014616502448916435], -6.693182244664058,
                 [-0.40493912103935037, -0.41660478289335934], 0.5663716685222396),
}
REFERENCE_XC = [-0.9052251577377319, 1.4483718872070312, 0.6267537474632263]
REFERENCE_X_SUM = 21.623747556470335


@pytest.mark.parametrize("kernel", sorted(REFERENCE_1D))
def test_default_1d_stream_is_unchanged(kernel):
    counts, yt_tail, y_sum, yc_second, after = REFERENCE_1D[kernel]
    gen = torch.Generator().manual_seed(7)
    sampler = GPSampler(kernel)
    first = sampler.sample(3, generator=gen)
    second = sampler.sample(2, generator=gen, num_context=5, num_target=4, dtype=torch.float64)
    assert (first.xc.shape[1], first.xt.shape[1]) == counts
    # x is pure RNG output: bit for bit; y goes through a Cholesky, whose last bits may depend on LAPACK.
    assert first.xc[0, :3, 0].tolist() == REFERENCE_XC
    assert torch.cat([first.xc, first.xt], 1).double().sum().item() == pytest.approx(REFERENCE_X_SUM, abs=1e-12)
    assert first.yt[-1, -3:, 0].tolist() == pytest.approx(yt_tail, abs=1e-6)
    assert torch.cat([first.yc, first.yt], 1).double().sum().item() == pytest.approx(y_sum, abs=1e-4)
    assert second.yc[1, :2, 0].tolist() == pytest.approx(yc_second, abs=1e-9)
    assert torch.rand(1, generator=gen, dtype=torch.float64).item() == after  # no extra draws anywhere


def test_dim_x_ranges_counts_and_seeding():
    sampler = GPSampler("matern52", dim_x=2)
    batch = sampler.sample(64, generator=torch.Generator().manual_seed(0), num_context=64, num_target=128)
    assert batch.xc.shape == (64, 64, 2) and batch.xt.shape == (64, 128, 2)
    assert batch.yc.shape == (64, 64, 1) and batch.yt.shape == (64, 128, 1)
    x = torch.cat([batch.xc, batch.xt], 1).reshape(-1, 2)
    for d in range(2):  # each coordinate covers [-2, 2) on its own
        assert x[:, d].min() >= -2 and x[:, d].max() < 2 and x[:, d].min() < -1.99 and x[:, d].max() > 1.99
    assert abs(torch.corrcoef(x.T)[0, 1].item()) < 0.02  # independent coordinates
    again = sampler.sample(64, generator=torch.Generator().manual_seed(0), num_context=64, num_target=128)
    other = sampler.sample(64, generator=torch.Generator().manual_seed(1), num_context=64, num_target=128)
    assert all(torch.equal(u, v) for u, v in zip(batch, again))
    assert not torch.equal(batch.yt, other.yt)
    random_counts = GPSampler(dim_x=3).sample(2, generator=torch.Generator().manual_seed(0))
    assert random_counts.xc.shape[-1] == 3 and 3 <= random_counts.xc.shape[1] <= 46


def test_kernels_use_the_euclidean_distance_in_2d():
    x = torch.tensor([[[0.0, 0.0], [0.3, 0.4]]], dtype=torch.float64)  # distance 0.5
    one, half = torch.ones(1, dtype=torch.float64), torch.full((1,), 0.5, dtype=torch.float64)
    s5 = math.sqrt(5)
    assert kernel_matrix("rbf", x, half, one)[0, 0, 1].item() == pytest.approx(math.exp(-0.5))
    assert kernel_matrix("matern52", x, half, one)[0, 0, 1].item() == pytest.approx((1 + s5 + 5 / 3) * math.exp(-s5))
    periodic = kernel_matrix("periodic", x, one, one, period=torch.full((1,), 0.3, dtype=torch.float64))
    assert periodic[0, 0, 1].item() == pytest.approx(math.exp(-2 * math.sin(math.pi * 0.5 / 0.3) ** 2))


def _kernel_of_distance(kernel, d, length, scale, period):
    if kernel == "rbf":
        return scale ** 2 * torch.exp(-0.5 * (d / length) ** 2)
    if kernel == "matern52":
        r = math.sqrt(5) * d / length
        return scale ** 2 * (1 + r + r ** 2 / 3) * torch.exp(-r)
    return scale ** 2 * torch.exp(-2 * (torch.sin(math.pi * d / period) / length) ** 2)


@pytest.mark.parametrize("kernel", ["rbf", "matern52", "periodic"])
def test_2d_covariance_of_two_points_is_the_kernel(kernel):
    # Each task is one pair of points; given x, E[y1 y2] = k(|x1 − x2|) and E[y1²] = k(0) + noise². The
    # mean of y1 y2 − k over many tasks must be 0 within a few standard errors, and the same statistic
    # with the distance along the first coordinate only (the 1-D formula) must not be.
    # A period longer than the largest distance (2√2): the periodic kernel is then monotone in it too.
    length, scale, period, n = 0.8, 0.9, 3.0, 40000
    sampler = GPSampler(kernel, length_range=(length, length), scale_range=(scale, scale),
                        period_range=(period, period), x_range=(-1.0, 1.0), dim_x=2)
    batch = sampler.sample(n, generator=torch.Generator().manual_seed(5), num_context=1, num_target=1,
                           dtype=torch.float64)
    x1, x2, y1, y2 = batch.xc[:, 0], batch.xt[:, 0], batch.yc[:, 0, 0], batch.yt[:, 0, 0]

    def z_score(k):
        r = y1 * y2 - k
        return r.mean().item() / (r.std().item() / math.sqrt(n))

    assert abs(z_score(_kernel_of_distance(kernel, (x1 - x2).norm(dim=-1), length, scale, period))) < 4
    assert abs(z_score(_kernel_of_distance(kernel, (x1 - x2)[:, 0].abs(), length, scale, period))) > 8
    var = y1.pow(2) - (scale ** 2 + 0.02 ** 2)
    assert abs(var.mean().item() / (var.std().item() / math.sqrt(n))) < 4


def test_bad_arguments_name_themselves():
    for kwargs, name in ((dict(dim_x=0), "dim_x"), (dict(dim_x=1.5), "dim_x"), (dict(dim_x=True), "dim_x"),
                         (dict(x_range=(2.0, -2.0)), "x_range"), (dict(x_range=(1.0,)), "x_range"),
                         (dict(length_range=(0.0, 0.5)), "length_range"), (dict(scale_range=(1.0, 0.1)), "scale_range"),
                         (dict(period_range=(-1.0, 0.5)), "period_range"), (dict(noise_std=-0.1), "noise_std")):
        with pytest.raises(ValueError, match=name):
            GPSampler(**kwargs)
    for kwargs, name in ((dict(num_context=0), "num_context"), (dict(num_target=-3), "num_target"),
                         (dict(num_context=2.5), "num_context")):
        with pytest.raises(ValueError, match=name):
            GPSampler().sample(2, torch.Generator().manual_seed(0), **kwargs)


def test_docstring_examples():
    import doctest
    import importlib

    for name in ("attn_ext.data", "attn_ext.data.gp"):
        result = doctest.testmod(importlib.import_module(name))
        assert result.attempted > 0 and result.failed == 0, name
