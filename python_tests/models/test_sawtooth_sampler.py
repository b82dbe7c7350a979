"""attn_ext.data.SawtoothSampler against its definition (docs/data.md): f(x) = frac(freq·⟨u, x⟩ + offset)
with freq ~ U[3, 5], u uniform on the unit sphere, offset ~ U[0, 1), x ~ U[−2, 2)^d, plus N(0, σ²) noise."""
import doctest
import importlib
import math

import numpy as np
import pytest
import torch

from attn_ext.data import GPSampler, NPBatch, SawtoothFunctions, SawtoothSampler
from attn_ext.data.sawtooth import FREQ_RANGE, NOISE_STD, sawtooth


def _draw(n=4000, dim_x=2, noise_std=0.0, seed=0, **kwargs):
    sampler = SawtoothSampler(dim_x=dim_x, noise_std=noise_std)
    return sampler.sample_with_functions(n, torch.Generator().manual_seed(seed), dtype=torch.float64, **kwargs)


def _circular(a, b):
    """Distance between values modulo 1 (0.999 and 0.001 are 0.002 apart)."""
    d = (a - b).abs() % 1.0
    return torch.minimum(d, 1 - d)


def test_shapes_counts_and_x_ranges_per_dimension():
    batch, _ = _draw(256, dim_x=3, num_context=64, num_target=128)
    assert isinstance(batch, NPBatch)
    assert batch.xc.shape == (256, 64, 3) and batch.xt.shape == (256, 128, 3)
    assert batch.yc.shape == (256, 64, 1) and batch.yt.shape == (256, 128, 1)
    x = torch.cat([batch.xc, batch.xt], 1).reshape(-1, 3)
    for d in range(3):
        assert x[:, d].min() >= -2 and x[:, d].max() < 2 and x[:, d].min() < -1.99 and x[:, d].max() > 1.99
    # Random counts: the GP sampler's distribution, from the same draws.
    saw, gp = SawtoothSampler(), GPSampler()
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert [saw.sample_counts(g1) for _ in range(200)] == [gp.sample_counts(g2) for _ in range(200)]
    random = saw.sample(2, torch.Generator().manual_seed(0))
    assert 3 <= random.xc.shape[1] <= 46 and 3 <= random.xt.shape[1] <= 49 - random.xc.shape[1]
    assert random.xc.dtype == torch.float32 and random.xc.shape[-1] == 1


def test_values_are_the_definition_in_zero_one_before_noise():
    batch, fn = _draw(2000, dim_x=2, num_context=16, num_target=16)
    x, y = torch.cat([batch.xc, batch.xt], 1), torch.cat([batch.yc, batch.yt], 1)
    # An independent float64 formula in numpy.
    xn, un = x.numpy(), fn.direction.numpy()
    expected = np.mod(fn.freq.numpy()[:, None] * np.einsum("bnd,bd->bn", xn, un) + fn.offset.numpy()[:, None], 1.0)
    assert _circular(y.squeeze(-1), torch.from_numpy(expected)).max() < 1e-12
    assert y.min() >= 0 and y.max() < 1 and y.min() < 1e-3 and y.max() > 1 - 1e-3
    # In fp32 too, where 1 − 1e-9 would round to 1.0.
    b32 = SawtoothSampler(dim_x=2, noise_std=0).sample(2000, torch.Generator().manual_seed(0), num_context=64,
                                                       num_target=128)
    assert b32.yt.min() >= 0 and b32.yt.max() < 1
    # Mapped into [0, 1) even where remainder rounds up to exactly 1.
    tiny = sawtooth(torch.zeros(1, 1, 1, dtype=torch.float64),
                    SawtoothFunctions(torch.ones(1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64),
                                      torch.full((1,), -1e-20, dtype=torch.float64)))
    assert tiny.item() == 0.0


def test_noise_is_gaussian_with_the_given_std():
    sampler = SawtoothSampler(dim_x=2)
    assert sampler.noise_std == NOISE_STD == 0.025
    batch, fn = sampler.sample_with_functions(500, torch.Generator().manual_seed(1), num_context=64, num_target=128,
                                              dtype=torch.float64)
    x, y = torch.cat([batch.xc, batch.xt], 1), torch.cat([batch.yc, batch.yt], 1)
    eps = (y - sawtooth(x, fn)).flatten()
    # Near a jump the noise-free value wraps; the residual taken modulo 1 is the noise there as well.
    eps = torch.where(eps > 0.5, eps - 1, torch.where(eps < -0.5, eps + 1, eps))
    n = eps.numel()
    assert abs(eps.mean().item()) < 4 * NOISE_STD / math.sqrt(n)
    assert eps.std().item() == pytest.approx(NOISE_STD, rel=4 * math.sqrt(2 / n) + 1e-3)
    assert abs(((eps / NOISE_STD) ** 4).mean().item() - 3) < 0.1  # Gaussian kurtosis


def test_frequency_offset_and_direction_distributions():
    n = 40000
    fn = SawtoothSampler(dim_x=2).sample_functions(n, torch.Generator().manual_seed(2))
    assert FREQ_RANGE == (3.0, 5.0)
    assert fn.freq.min() >= 3 and fn.freq.max() < 5
    for low, high, values in ((3.0, 5.0, fn.freq), (0.0, 1.0, fn.offset)):
        u = (values - low) / (high - low)
        counts = torch.histc(u, bins=10, min=0, max=1)  # uniform: n/10 per bin, binomial spread
        assert ((counts - n / 10).abs() < 5 * math.sqrt(n * 0.1 * 0.9)).all(), counts
    assert torch.allclose(fn.direction.norm(dim=-1), torch.ones(n, dtype=torch.float64))
    # Uniform on the circle: the angle is uniform (a |·|-normalised direction would sit on the diagonals).
    angle = torch.atan2(fn.direction[:, 1], fn.direction[:, 0])
    counts = torch.histc(angle, bins=16, min=-math.pi, max=math.pi)
    assert ((counts - n / 16).abs() < 5 * math.sqrt(n / 16)).all(), counts
    # In 3-D: mean 0 and second moment I/3, as for the uniform distribution on the sphere.
    u3 = SawtoothSampler(dim_x=3).sample_functions(n, torch.Generator().manual_seed(3)).direction
    assert u3.mean(0).abs().max() < 5 / math.sqrt(3 * n)
    assert torch.allclose(u3.T @ u3 / n, torch.eye(3, dtype=torch.float64) / 3, atol=0.01)
    # In 1-D the direction is a sign, both equally often.
    signs = SawtoothSampler(dim_x=1).sample_functions(n, torch.Generator().manual_seed(4)).direction
    assert set(signs.flatten().tolist()) == {-1.0, 1.0} and abs(signs.mean().item()) < 5 / math.sqrt(n)


def test_periodic_along_the_direction_and_constant_across_it():
    batch, fn = _draw(500, dim_x=2, num_context=8, num_target=8)
    x = torch.cat([batch.xc, batch.xt], 1)
    f = sawtooth(x, fn)
    u, period = fn.direction.unsqueeze(1), (1 / fn.freq).view(-1, 1, 1)
    for k in (1, 2, -3):
        assert _circular(sawtooth(x + k * period * u, fn), f).max() < 1e-9
    assert _circular(sawtooth(x + 0.5 * period * u, fn), f).min() > 0.5 - 1e-9  # half a period: half a tooth
    across = torch.stack([-fn.direction[:, 1], fn.direction[:, 0]], -1).unsqueeze(1)
    assert _circular(sawtooth(x + 0.37 * across, fn), f).max() < 1e-9
    # Slope freq along u: a step δ adds freq·δ modulo 1.
    delta = 0.01
    step = (sawtooth(x + delta * u, fn) - f) % 1.0
    assert torch.allclose(step, (fn.freq * delta).view(-1, 1, 1).expand_as(step), atol=1e-9)


def test_seeded_reproducibility():
    sampler = SawtoothSampler(dim_x=2)
    a = sampler.sample(8, torch.Generator().manual_seed(5), num_context=64, num_target=128)
    b = sampler.sample(8, torch.Generator().manual_seed(5), num_context=64, num_target=128)
    c = sampler.sample(8, torch.Generator().manual_seed(6), num_context=64, num_target=128)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not torch.equal(a.yt, c.yt) and not torch.equal(a.xc, c.xc)
    # The random counts are drawn even when fixed ones are given, so x starts at the same number.
    nc, _ = sampler.sample_counts(torch.Generator().manual_seed(5))
    d = sampler.sample(8, torch.Generator().manual_seed(5))
    assert d.xc.shape[1] == nc and torch.equal(d.xc[0], a.xc[0, :nc])


def test_bad_arguments_name_themselves():
    for kwargs, name in ((dict(dim_x=0), "dim_x"), (dict(dim_x=2.0), "dim_x"),
                         (dict(freq_range=(5.0, 3.0)), "freq_range"),
                         (dict(freq_range=(0.0, 1.0)), "freq_range"), (dict(freq_range=3.0), "freq_range"),
                         (dict(noise_std=-0.1), "noise_std"), (dict(noise_std=float("nan")), "noise_std"),
                         (dict(x_range=(2.0, -2.0)), "x_range"), (dict(max_points=5), "max_points")):
        with pytest.raises(ValueError, match=f"SawtoothSampler: {name}"):
            SawtoothSampler(**kwargs)
    sampler, gen = SawtoothSampler(), torch.Generator().manual_seed(0)
    for kwargs, name in ((dict(batch_size=0), "batch_size"), (dict(batch_size=2, num_context=0), "num_context"),
                         (dict(batch_size=2, num_target=1.5), "num_target")):
        with pytest.raises(ValueError, match=name):
            sampler.sample(generator=gen, **kwargs)
    fn = sampler.sample_functions(2, gen)
    with pytest.raises(ValueError, match=r"x \(2, 5, 2\) and direction \(2, 1\)"):
        sawtooth(torch.zeros(2, 5, 2), fn)


def test_docstring_examples():
    result = doctest.testmod(importlib.import_module("attn_ext.data.sawtooth"))
    assert result.attempted > 0 and result.failed == 0
