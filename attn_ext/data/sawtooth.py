"""Sawtooth meta-regression tasks: random plane waves with a sawtooth profile, in any input dimension.

The efficient-NP-transformers chapter reports a "Sawtooth" data set (2-D inputs, ``N_c = 64``,
``N_t = 128``) without defining it; this is the process of the ``neuralprocesses`` library and the
TE-TNP line of work that the chapter builds on. Per function: a frequency ``freq ~ U[3, 5]``, a
direction ``u`` uniform on the unit sphere of ``R^dim_x``, an offset ``φ ~ U[0, 1)``, and

    f(x) = frac(freq · ⟨u, x⟩ + φ)        (a sawtooth in [0, 1), period 1/freq along u)

observed as ``y = f(x) + ε``, ``ε ~ N(0, noise_std²)``, at ``x ~ U[−2, 2)^dim_x``. The default
``noise_std = 0.025`` is the TE-TNP experiments' value; see ``docs/data.md`` for why not the
``neuralprocesses`` default.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from attn_ext.data.gp import NPBatch, _uniform, check_counts, check_dim_x, check_range

#: The frequency range of the ``neuralprocesses`` sawtooth (3 to 5 teeth per unit along the direction).
FREQ_RANGE = (3.0, 5.0)
#: Observation noise of the TE-TNP sawtooth experiments: small next to the unit jump of a tooth.
NOISE_STD = 0.025


class SawtoothFunctions(NamedTuple):
    """The random parameters of a batch of sawtooth functions: ``freq [B]``, ``direction [B, dim_x]``
    (unit vectors), ``offset [B]``."""

    freq: Tensor
    direction: Tensor
    offset: Tensor


def sawtooth(x: Tensor, functions: SawtoothFunctions) -> Tensor:
    """The noise-free values ``[B, N, 1]`` in ``[0, 1)`` of ``functions`` at ``x [B, N, dim_x]``.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.data.sawtooth import SawtoothFunctions, sawtooth
    >>> fn = SawtoothFunctions(torch.tensor([4.0]), torch.tensor([[1.0, 0.0]]), torch.tensor([0.5]))
    >>> sawtooth(torch.tensor([[[0.0, 7.0], [0.125, 0.0], [0.25, 0.0]]]), fn).flatten().tolist()
    [0.5, 0.0, 0.5]
    """
    if x.dim() != 3 or functions.direction.shape != (x.shape[0], x.shape[-1]):
        raise ValueError(f"sawtooth: x must be [B, N, dim_x] with direction [B, dim_x], got x {tuple(x.shape)} "
                         f"and direction {tuple(functions.direction.shape)}")
    phase = functions.freq.view(-1, 1) * (x @ functions.direction.unsqueeze(-1)).squeeze(-1)
    f = torch.remainder(phase + functions.offset.view(-1, 1), 1.0)
    # remainder(-tiny, 1) rounds to exactly 1.0; that is 0.0 modulo 1, and keeps the range half-open.
    return torch.where(f >= 1.0, torch.zeros_like(f), f).unsqueeze(-1)


class SawtoothSampler:
    """Draws batches of sawtooth regression tasks, with the interface of :class:`attn_ext.data.GPSampler`.

    Parameters
    ----------
    dim_x : int
        Input dimension (the efficient-NP chapter's Table 0.5.1 uses 2).
    freq_range : (float, float)
        Range of the uniform frequency, default (3, 5).
    noise_std : float
        Standard deviation of the Gaussian observation noise added to ``f`` (default 0.025; 0 gives
        the noise-free sawtooth in ``[0, 1)``).
    x_range : (float, float)
        Range of every coordinate of ``x``, default [−2, 2).
    max_points : int
        Random counts as the GP sampler's: ``N_c ~ U{3..max_points−4}``, ``N_t ~ U{3..max_points−1−N_c}``.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.data import SawtoothSampler
    >>> gen = torch.Generator().manual_seed(0)
    >>> batch = SawtoothSampler(dim_x=2).sample(8, generator=gen, num_context=64, num_target=128)
    >>> tuple(batch.xc.shape), tuple(batch.yt.shape)
    ((8, 64, 2), (8, 128, 1))
    >>> bool(batch.xt.abs().max() <= 2.0)
    True
    """

    def __init__(self, *, dim_x: int = 1, freq_range: Tuple[float, float] = FREQ_RANGE, noise_std: float = NOISE_STD,
                 x_range: Tuple[float, float] = (-2.0, 2.0), max_points: int = 50) -> None:
        self.dim_x = check_dim_x("SawtoothSampler", dim_x)
        self.freq_range = check_range("SawtoothSampler", "freq_range", freq_range, positive=True)
        self.x_range = check_range("SawtoothSampler", "x_range", x_range)
        if not noise_std >= 0:
            raise ValueError(f"SawtoothSampler: noise_std must be >= 0, got {noise_std!r}")
        if isinstance(max_points, bool) or not isinstance(max_points, int) or max_points < 10:
            raise ValueError(f"SawtoothSampler: max_points must be an int >= 10, got {max_points!r}")
        self.noise_std, self.max_points = float(noise_std), max_points

    def __repr__(self) -> str:
        return (f"SawtoothSampler(dim_x={self.dim_x}, freq_range={self.freq_range}, noise_std={self.noise_std}, "
                f"x_range={self.x_range})")

    def sample_counts(self, generator: Optional[torch.Generator] = None) -> Tuple[int, int]:
        """``(N_c, N_t)`` for one batch, drawn as :meth:`attn_ext.data.GPSampler.sample_counts` draws them."""
        num_ctx = int(torch.randint(3, self.max_points - 3, (1,), generator=generator))
        num_tar = int(torch.randint(3, self.max_points - num_ctx, (1,), generator=generator))
        return num_ctx, num_tar

    def sample_functions(self, batch_size: int, generator: Optional[torch.Generator] = None) -> SawtoothFunctions:
        """The parameters of ``batch_size`` random sawtooth functions, in float64."""
        f64 = torch.float64
        freq = _uniform(*self.freq_range, (batch_size,), generator, f64)
        # A normalised standard normal vector is uniform on the sphere (rotation invariance); dividing
        # by the absolute values instead would only give the 2^d diagonal directions.
        direction = torch.randn(batch_size, self.dim_x, generator=generator, dtype=f64)
        direction = direction / direction.norm(dim=-1, keepdim=True)
        offset = torch.rand(batch_size, generator=generator, dtype=f64)
        return SawtoothFunctions(freq, direction, offset)

    def sample_with_functions(self, batch_size: int, generator: Optional[torch.Generator] = None, *,
                              num_context: Optional[int] = None, num_target: Optional[int] = None,
                              dtype: torch.dtype = torch.float32) -> Tuple[NPBatch, SawtoothFunctions]:
        """:meth:`sample` and the functions the batch was drawn from (for tests and figures)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"SawtoothSampler.sample: batch_size must be a positive int, got {batch_size!r}")
        check_counts("SawtoothSampler.sample", num_context, num_target)
        # The random counts are drawn even when overridden, as the GP sampler does: the stream of
        # numbers after them then does not depend on the override.
        num_ctx, num_tar = self.sample_counts(generator)
        num_ctx, num_tar = num_context or num_ctx, num_target or num_tar
        f64 = torch.float64
        x = _uniform(*self.x_range, (batch_size, num_ctx + num_tar, self.dim_x), generator, f64)
        functions = self.sample_functions(batch_size, generator)
        f = sawtooth(x, functions)
        if self.noise_std > 0:
            y = (f + self.noise_std * torch.randn(f.shape, generator=generator, dtype=f64)).to(dtype)
        else:  # keep [0, 1) after the cast: 1 − 1e-9 would round to 1.0 in fp32
            y = torch.minimum(f.to(dtype), torch.nextafter(torch.ones((), dtype=dtype), torch.zeros((), dtype=dtype)))
        x = x.to(dtype)
        return NPBatch(x[:, :num_ctx], y[:, :num_ctx], x[:, num_ctx:], y[:, num_ctx:]), functions

    def sample(self, batch_size: int, generator: Optional[torch.Generator] = None, *,
               num_context: Optional[int] = None, num_target: Optional[int] = None,
               dtype: torch.dtype = torch.float32) -> NPBatch:
        """One batch of ``batch_size`` tasks; ``num_context``/``num_target`` override the random counts."""
        return self.sample_with_functions(batch_size, generator, num_context=num_context, num_target=num_target,
                                          dtype=dtype)[0]
