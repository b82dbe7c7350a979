"""Data of the point-cloud remapping task: random similarity transforms of 2-D points, and a rabbit.

The Intention paper's generalised Kabsch task (its §5.4 and the appendix section on it): a task
draws a transform ``f(k) = a·R k + w`` (rescaling ``a``, rotation ``R``, translation ``w``); the
network sees ``N = 5`` points ``k_i`` and their noisy images ``v_i = f(k_i) + ε`` and must apply
the noise-free ``f`` to query points. The paper does not give the distributions, so ours are:
points ``k, q ~ N(0, I₂)``, angle ``~ U[0, 2π)`` (proper rotations, det R = 1), ``a ~ U[0.5, 2]``,
``w ~ N(0, I₂)``, ``ε ~ N(0, 0.05² I₂)``.

Torch is imported inside the functions (the harness imports task modules to build ``--help``).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

SCALE_RANGE = (0.5, 2.0)
TRANSLATION_STD = 1.0
NOISE_STD = 0.05


class RemapBatch(NamedTuple):
    """One batch of remapping tasks: observed pairs, queries, their noise-free images and the transforms."""

    k: "object"            # [B, N, 2] observed points
    v: "object"            # [B, N, 2] their transformed, noisy images
    q: "object"            # [B, M, 2] query points
    z: "object"            # [B, M, 2] a·R q + w, the targets
    scale: "object"        # [B]
    rotation: "object"     # [B, 2, 2]
    translation: "object"  # [B, 2]


def random_similarity(batch: int, generator, *, dtype=None):
    """Draw ``batch`` transforms: ``(a [B], R [B, 2, 2], w [B, 2])`` as described in the module notes."""
    dtype = dtype or torch.float32
    angle = torch.rand(batch, generator=generator, dtype=torch.float64) * (2 * math.pi)
    cos, sin = angle.cos(), angle.sin()
    rotation = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2)
    lo, hi = SCALE_RANGE
    scale = lo + (hi - lo) * torch.rand(batch, generator=generator, dtype=torch.float64)
    translation = TRANSLATION_STD * torch.randn(batch, 2, generator=generator, dtype=torch.float64)
    return scale.to(dtype), rotation.to(dtype), translation.to(dtype)


def apply_similarity(points, scale, rotation, translation):
    """``a·R p + w`` for every point ``p`` of ``points [B, n, 2]``."""
    if points.dim() != 3 or points.shape[-1] != 2 or rotation.shape != (points.shape[0], 2, 2) \
            or scale.shape != (points.shape[0],) or translation.shape != (points.shape[0], 2):
        raise ValueError(f"apply_similarity: need points [B, n, 2], scale [B], rotation [B, 2, 2], translation "
                         f"[B, 2]; got {tuple(points.shape)}, {tuple(scale.shape)}, {tuple(rotation.shape)}, "
                         f"{tuple(translation.shape)}")
    return scale[:, None, None] * points @ rotation.mT + translation[:, None, :]


def sample_remap_tasks(batch: int, *, n_obs: int = 5, n_query: int = 5, noise_std: float = NOISE_STD,
                       generator=None, dtype=None) -> RemapBatch:
    """A batch of remapping tasks (see the module notes for the distributions).

    Examples
    --------
    >>> import torch
    >>> b = sample_remap_tasks(3, generator=torch.Generator().manual_seed(0))
    >>> tuple(b.k.shape), tuple(b.q.shape), tuple(b.z.shape)
    ((3, 5, 2), (3, 5, 2), (3, 5, 2))
    """
    if batch < 1 or n_obs < 1 or n_query < 1 or not noise_std >= 0:
        raise ValueError(f"sample_remap_tasks: need batch, n_obs, n_query >= 1 and noise_std >= 0; got {batch}, "
                         f"{n_obs}, {n_query}, {noise_std}")
    dtype = dtype or torch.float32
    scale, rotation, translation = random_similarity(batch, generator, dtype=dtype)
    k = torch.randn(batch, n_obs, 2, generator=generator, dtype=dtype)
    q = torch.randn(batch, n_query, 2, generator=generator, dtype=dtype)
    noise = noise_std * torch.randn(batch, n_obs, 2, generator=generator, dtype=dtype)
    v = apply_similarity(k, scale, rotation, translation) + noise
    return RemapBatch(k, v, q, apply_similarity(q, scale, rotation, translation), scale, rotation, translation)


def umeyama(k, v):
    """Least-squares similarity transform from ``k [B, n, 2]`` to ``v [B, n, 2]`` (Umeyama, 1991).

    The closed-form Kabsch/Umeyama fit that the networks are asked to learn: returns
    ``(a [B], R [B, 2, 2], w [B, 2])`` minimising ``Σ_i ‖v_i − (a R k_i + w)‖²`` over proper rotations.
    """
    mk, mv = k.mean(1, keepdim=True), v.mean(1, keepdim=True)
    kc, vc = k - mk, v - mv
    cov = vc.mT @ kc / k.shape[1]                                   # [B, 2, 2]
    u, s, vt = torch.linalg.svd(cov)
    sign = torch.sign(torch.linalg.det(u @ vt))
    sign = torch.where(sign == 0, torch.ones_like(sign), sign)      # degenerate (collinear) sets: keep R proper
    fix = torch.diag_embed(torch.stack([torch.ones_like(sign), sign], -1))
    rotation = u @ fix @ vt
    spread = kc.pow(2).sum((1, 2)) / k.shape[1]
    scale = (s * torch.stack([torch.ones_like(sign), sign], -1)).sum(-1) / spread
    translation = mv[:, 0] - scale[:, None] * (rotation @ mk[:, 0, :, None])[..., 0]
    return scale, rotation, translation


#: The rabbit silhouette: (centre x, centre y, radius x, radius y, angle in degrees) of each ellipse.
RABBIT_PARTS = (
    (0.0, 0.0, 1.05, 0.72, 0.0),       # body
    (1.05, 0.55, 0.45, 0.40, 0.0),     # head
    (0.92, 1.28, 0.13, 0.48, 12.0),    # ear (back)
    (1.22, 1.25, 0.13, 0.48, -14.0),   # ear (front)
    (-1.08, 0.12, 0.20, 0.20, 0.0),    # tail
    (0.55, -0.70, 0.32, 0.12, 0.0),    # front paw
    (-0.55, -0.68, 0.42, 0.14, 0.0),   # hind paw
)


def rabbit_cloud(n_points: int, generator=None, *, dtype=None):
    """``[n_points, 2]`` points drawn uniformly inside a rabbit silhouette, centred, per-axis-pooled unit std.

    A procedural stand-in for the scanned rabbit of the paper's Figure 11 (no data download). It is
    normalised like the training points (mean 0, standard deviation 1 pooled over both axes), so a
    model trained on ``N(0, I)`` points sees it in distribution.
    """
    if n_points < 1:
        raise ValueError(f"rabbit_cloud: need n_points >= 1, got {n_points}")
    dtype = dtype or torch.float32
    kept, total = [], 0
    while total < n_points:  # rejection sampling from the bounding box; about half the draws land inside
        xy = torch.rand(4 * n_points, 2, generator=generator, dtype=torch.float64) * torch.tensor([3.0, 3.6]) \
            - torch.tensor([1.4, 1.0])
        inside = torch.zeros(xy.shape[0], dtype=torch.bool)
        for cx, cy, rx, ry, deg in RABBIT_PARTS:
            c, s = math.cos(math.radians(deg)), math.sin(math.radians(deg))
            dx, dy = xy[:, 0] - cx, xy[:, 1] - cy
            u, w = c * dx + s * dy, -s * dx + c * dy
            inside |= (u / rx) ** 2 + (w / ry) ** 2 <= 1
        kept.append(xy[inside])
        total += int(inside.sum())
    cloud = torch.cat(kept)[:n_points]
    cloud = cloud - cloud.mean(0)
    return (cloud / cloud.pow(2).mean().sqrt()).to(dtype)


def normalised_cloud(points, n_points: int, generator=None, *, dtype=None):
    """A user's 2-D point cloud (``--shape``) as the rabbit demo's input: ``n_points`` of its points (all of
    them if it has fewer; a random subset drawn from ``generator`` otherwise), normalised like
    :func:`rabbit_cloud` (mean 0, unit standard deviation pooled over both axes)."""
    if not isinstance(points, torch.Tensor) or points.dim() != 2 or points.shape[1] != 2 or points.shape[0] < 5 \
            or not points.is_floating_point() or not bool(torch.isfinite(points).all()):
        raise ValueError(f"normalised_cloud: need a finite real [n >= 5, 2] point cloud, got "
                         f"{getattr(points, 'shape', type(points).__name__)}")
    points = points.double()
    if points.shape[0] > n_points:
        points = points[torch.randperm(points.shape[0], generator=generator)[:n_points]]
    cloud = points - points.mean(0)
    spread = cloud.pow(2).mean().sqrt()
    if float(spread) == 0:
        raise ValueError("normalised_cloud: all points coincide")
    return (cloud / spread).to(dtype or torch.float32)
