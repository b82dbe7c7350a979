"""GP meta-regression tasks as sampled by the official TNP/LBANP/CMANP code (docs/spec.md §6).

Per batch: ``N_c ~ U{3..46}`` and ``N_t ~ U{3..49 − N_c}`` shared by every function of the batch
(or fixed counts, e.g. the efficient-NP chapter's ``N_c = 64``, ``N_t = 128``); per point
``x ~ U[−2, 2)^dim_x`` (``dim_x = 1`` by default; the kernels act on the Euclidean distance); per
function a length ``~ U[0.1, 0.6)`` (the code's default; the CMANP paper's text says ``U[0.6, 1.0)``,
selectable as ``length_range="paper"``), a scale ``~ U[0.1, 1.0)`` and, for the periodic kernel, a
period ``~ U[0.1, 0.5)``. ``y`` is drawn jointly over context and
targets from ``N(0, K + 0.02² I)``, so the 0.02 observation noise is part of every ``y``.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from attn_ext.data.batch import NPBatch, PackedNPBatch, pack_tasks

KERNELS = ("rbf", "matern52", "periodic")
#: Named length ranges: the official code's and the CMANP paper text's.
LENGTH_RANGES = {"code": (0.1, 0.6), "paper": (0.6, 1.0)}


def _uniform(low: float, high: float, shape, generator, dtype) -> Tensor:
    return low + (high - low) * torch.rand(shape, generator=generator, dtype=dtype)


def check_range(owner: str, name: str, value, *, positive: bool = False) -> Tuple[float, float]:
    """``value`` as a ``(low, high)`` float pair with ``low <= high`` (and ``low > 0`` if ``positive``),
    else a ValueError naming ``owner`` and the argument ``name``."""
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{owner}: {name} must be a (low, high) pair, got {value!r}") from None
    if not low <= high or (positive and not low > 0):
        raise ValueError(f"{owner}: {name} must have {'0 < ' if positive else ''}low <= high, got {value!r}")
    return low, high


def check_counts(owner: str, num_context: Optional[int], num_target: Optional[int]) -> None:
    """Fixed counts must be positive integers (``None`` keeps the random counts)."""
    for name, value in (("num_context", num_context), ("num_target", num_target)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{owner}: {name} must be a positive int or None, got {value!r}")


def check_dim_x(owner: str, dim_x) -> int:
    """``dim_x`` if it is a positive int (not a bool or a float), else a ValueError naming ``owner``."""
    if isinstance(dim_x, bool) or not isinstance(dim_x, int) or dim_x < 1:
        raise ValueError(f"{owner}: dim_x must be a positive int, got {dim_x!r}")
    return dim_x


def kernel_matrix(kernel: str, x: Tensor, length: Tensor, scale: Tensor, period: Optional[Tensor] = None) -> Tensor:
    """Noise-free covariance ``[B, N, N]`` of ``x [B, N, dx]`` with per-function ``length``, ``scale``
    (and ``period``), each ``[B]``; the same formulas as the official sampler."""
    length, scale = length.view(-1, 1, 1), scale.view(-1, 1, 1)
    diff = x.unsqueeze(-2) - x.unsqueeze(-3)
    if kernel == "rbf":
        return scale ** 2 * torch.exp(-0.5 * (diff / length.unsqueeze(-1)).pow(2).sum(-1))
    if kernel == "matern52":
        d = (diff / length.unsqueeze(-1)).norm(dim=-1)
        return scale ** 2 * (1 + math.sqrt(5) * d + 5 * d ** 2 / 3) * torch.exp(-math.sqrt(5) * d)
    if kernel == "periodic":
        d = diff.norm(dim=-1)
        return scale ** 2 * torch.exp(-2 * (torch.sin(math.pi * d / period.view(-1, 1, 1)) / length) ** 2)
    raise ValueError(f"unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}")


class GPSampler:
    """Draws batches of GP regression tasks (docs/spec.md §6, the official sampler), 1-D by default.

    Parameters
    ----------
    kernel : {"rbf", "matern52", "periodic"}
    length_range : "code", "paper" or (float, float)
        Range of the uniform length scale: ``"code"`` = [0.1, 0.6) (default), ``"paper"`` = [0.6, 1.0).
    scale_range, period_range : (float, float)
        Ranges of the uniform output scale and (periodic kernel) period.
    noise_std : float
        Observation noise added to the covariance diagonal.
    max_points : int
        ``N_c + N_t <= max_points − 1``: ``N_c ~ U{3..max_points−4}``, ``N_t ~ U{3..max_points−1−N_c}``.
    x_range : (float, float)
        Range of every coordinate of ``x``.
    dim_x : int
        Input dimension: ``x ~ U[x_range]^dim_x``; the kernels depend on ``x`` through the Euclidean
        distance (RBF and Matérn with one length scale for every dimension). ``dim_x = 1`` draws exactly
        the numbers it always drew (the fixed-seed evaluation sets depend on it).

    Examples
    --------
    >>> import torch
    >>> from attn_ext.data import GPSampler
    >>> gen = torch.Generator().manual_seed(0)
    >>> batch = GPSampler("matern52").sample(16, generator=gen)
    >>> 3 <= batch.xc.shape[1] <= 46 and 3 <= batch.xt.shape[1] <= 49 - batch.xc.shape[1]
    True
    >>> batch.yc.shape == batch.xc.shape
    True
    >>> GPSampler(dim_x=2).sample(4, generator=gen, num_context=64, num_target=128).xt.shape
    torch.Size([4, 128, 2])
    """

    def __init__(self, kernel: str = "rbf", *, length_range: Union[str, Tuple[float, float]] = "code",
                 scale_range: Tuple[float, float] = (0.1, 1.0), period_range: Tuple[float, float] = (0.1, 0.5),
                 noise_std: float = 0.02, max_points: int = 50, x_range: Tuple[float, float] = (-2.0, 2.0),
                 dim_x: int = 1) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
        if isinstance(length_range, str):
            if length_range not in LENGTH_RANGES:
                raise ValueError(f"unknown length_range {length_range!r}; choose one of {', '.join(LENGTH_RANGES)} "
                                 "or pass (low, high)")
            length_range = LENGTH_RANGES[length_range]
        if max_points < 10:
            raise ValueError(f"max_points must be >= 10, got {max_points}")
        if not noise_std >= 0:
            raise ValueError(f"GPSampler: noise_std must be >= 0, got {noise_std!r}")
        self.kernel, self.noise_std, self.max_points = kernel, noise_std, max_points
        self.length_range = check_range("GPSampler", "length_range", length_range, positive=True)
        self.scale_range = check_range("GPSampler", "scale_range", scale_range)
        self.period_range = check_range("GPSampler", "period_range", period_range, positive=True)
        self.x_range = check_range("GPSampler", "x_range", x_range)
        self.dim_x = check_dim_x("GPSampler", dim_x)

    def __repr__(self) -> str:
        return (f"GPSampler({self.kernel!r}, length_range={self.length_range}, scale_range={self.scale_range}, "
                f"noise_std={self.noise_std}" + (f", dim_x={self.dim_x})" if self.dim_x != 1 else ")"))

    def sample_counts(self, generator: Optional[torch.Generator] = None) -> Tuple[int, int]:
        """``(N_c, N_t)`` for one batch, as the official ``torch.randint(3, 47)``, ``randint(3, 50 − N_c)``."""
        num_ctx = int(torch.randint(3, self.max_points - 3, (1,), generator=generator))
        num_tar = int(torch.randint(3, self.max_points - num_ctx, (1,), generator=generator))
        return num_ctx, num_tar

    def sample(self, batch_size: int, generator: Optional[torch.Generator] = None, *,
               num_context: Optional[int] = None, num_target: Optional[int] = None,
               dtype: torch.dtype = torch.float32) -> NPBatch:
        """One batch of ``batch_size`` tasks; ``num_context``/``num_target`` override the random counts
        (which are drawn all the same, so that the stream of numbers does not depend on them)."""
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        check_counts("GPSampler.sample", num_context, num_target)
        num_ctx, num_tar = self.sample_counts(generator)
        num_ctx, num_tar = num_context or num_ctx, num_target or num_tar
        n = num_ctx + num_tar
        # Drawn in float64: a Cholesky of a smooth 50-point kernel with 0.02² jitter is fragile in fp32.
        f64 = torch.float64
        x = _uniform(*self.x_range, (batch_size, n, self.dim_x), generator, f64)
        length = _uniform(*self.length_range, (batch_size,), generator, f64)
        scale = _uniform(*self.scale_range, (batch_size,), generator, f64)
        period = _uniform(*self.period_range, (batch_size,), generator, f64) if self.kernel == "periodic" else None
        cov = kernel_matrix(self.kernel, x, length, scale, period)
        cov = cov + self.noise_std ** 2 * torch.eye(n, dtype=f64)
        y = torch.linalg.cholesky(cov) @ torch.randn(batch_size, n, 1, generator=generator, dtype=f64)
        x, y = x.to(dtype), y.to(dtype)
        return NPBatch(x[:, :num_ctx], y[:, :num_ctx], x[:, num_ctx:], y[:, num_ctx:])

    def sample_packed(self, batch_size: int, generator: Optional[torch.Generator] = None, *,
                      dtype: torch.dtype = torch.float32) -> PackedNPBatch:
        """``batch_size`` tasks, each with its own ``(N_c, N_t)`` (drawn as :meth:`sample_counts` draws a batch's),
        packed end to end (:class:`~attn_ext.data.PackedNPBatch`): task ``b`` is what :meth:`sample` of one
        task with those counts draws next from ``generator``."""
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        tasks = []
        for _ in range(batch_size):
            num_ctx, num_tar = self.sample_counts(generator)
            tasks.append(self.sample(1, generator, num_context=num_ctx, num_target=num_tar, dtype=dtype))
        return pack_tasks(tasks)
