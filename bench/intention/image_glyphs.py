"""Procedurally drawn digit-like glyphs: an offline stand-in for MNIST in the image-regression task.

MNIST cannot be downloaded here, so :func:`sample_glyphs` draws MNIST-like images instead: one of ten
hand-made polyline templates of the digits 0–9, its vertices jittered, then rotated, sheared, scaled
and shifted at random, rendered as a thick anti-aliased white stroke on black. Like MNIST the images
are mostly background (about a fifth of the pixels carry ink; MNIST's thinner strokes about a
tenth), values lie in [0, 1], and the ten classes share strokes, so a model can learn what a "digit"
looks like and fill one in from a few pixels. Everything is torch, vectorised over the batch, and
reproducible from a ``torch.Generator``.
"""
from __future__ import annotations

import torch

#: Polyline templates of the digits 0–9 in the unit box (x to the right, y downwards).
DIGIT_TEMPLATES = (
    ((0.5, 0.1), (0.72, 0.22), (0.78, 0.5), (0.72, 0.78), (0.5, 0.9), (0.28, 0.78), (0.22, 0.5), (0.28, 0.22),
     (0.5, 0.1)),
    ((0.35, 0.25), (0.52, 0.1), (0.52, 0.9)),
    ((0.25, 0.3), (0.35, 0.12), (0.65, 0.12), (0.75, 0.3), (0.25, 0.9), (0.78, 0.9)),
    ((0.25, 0.15), (0.7, 0.15), (0.45, 0.45), (0.72, 0.6), (0.65, 0.85), (0.25, 0.85)),
    ((0.65, 0.9), (0.65, 0.1), (0.2, 0.65), (0.8, 0.65)),
    ((0.75, 0.1), (0.3, 0.1), (0.28, 0.45), (0.65, 0.45), (0.75, 0.7), (0.6, 0.9), (0.25, 0.88)),
    ((0.7, 0.1), (0.35, 0.4), (0.28, 0.7), (0.45, 0.9), (0.7, 0.8), (0.7, 0.6), (0.5, 0.5), (0.3, 0.65)),
    ((0.2, 0.1), (0.8, 0.1), (0.4, 0.9)),
    ((0.5, 0.5), (0.3, 0.3), (0.5, 0.1), (0.7, 0.3), (0.5, 0.5), (0.3, 0.7), (0.5, 0.9), (0.7, 0.7), (0.5, 0.5)),
    ((0.7, 0.4), (0.5, 0.5), (0.3, 0.35), (0.5, 0.12), (0.7, 0.3), (0.7, 0.4), (0.4, 0.9)),
)
#: Ranges of the random distortions (uniform), in units of the image side.
JITTER_STD, ROTATION, SHEAR, SCALE, SHIFT, HALF_WIDTH = 0.025, (-0.25, 0.25), (-0.2, 0.2), (0.8, 1.05), \
    (-0.08, 0.08), (0.025, 0.05)


def render_polylines(vertices, half_width, side: int):
    """Ink of thick polylines on a ``side`` × ``side`` grid of pixel centres in the unit box.

    A pixel's ink is ``clamp(1 − (d − w)·side, 0, 1)``, ``d`` its distance to the nearest segment and
    ``w`` the half-width: 1 inside the stroke, falling to 0 over one pixel (anti-aliasing).

    Parameters
    ----------
    vertices : Tensor ``[B, V, 2]``
        Consecutive vertices; repeating the last vertex pads a short polyline harmlessly.
    half_width : Tensor ``[B]``
    side : int

    Returns
    -------
    Tensor ``[B, side, side]`` (row = y, column = x)
    """
    if (vertices.dim() != 3 or vertices.shape[-1] != 2 or vertices.shape[1] < 2
            or half_width.shape != vertices.shape[:1]):
        raise ValueError(f"render_polylines: expected vertices [B, V >= 2, 2] and half_width [B], got "
                         f"{tuple(vertices.shape)} and {tuple(half_width.shape)}")
    centres = (torch.arange(side, dtype=vertices.dtype) + 0.5) / side
    py, px = torch.meshgrid(centres, centres, indexing="ij")
    p = torch.stack([px, py], -1).reshape(1, 1, -1, 2)  # [1, 1, P, 2]
    a, b = vertices[:, :-1, None, :], vertices[:, 1:, None, :]  # [B, S, 1, 2]
    ab = b - a
    # projection of each pixel on each segment, clamped to the segment; zero-length segments give t = 0
    t = (((p - a) * ab).sum(-1) / (ab * ab).sum(-1).clamp_min(1e-12)).clamp(0, 1)
    d = (p - (a + t.unsqueeze(-1) * ab)).norm(dim=-1).amin(1)  # [B, P]
    ink = (1 - (d - half_width[:, None]) * side).clamp(0, 1)
    return ink.reshape(-1, side, side)


def sample_glyphs(batch: int, side: int, generator):
    """Draw ``batch`` random digit-like glyphs.

    Returns
    -------
    dict
        ``images [B, side, side]`` in [0, 1] and ``labels [B]`` (the template drawn, uniform over 0–9).

    Examples
    --------
    >>> import torch
    >>> g = sample_glyphs(3, 28, torch.Generator().manual_seed(0))
    >>> tuple(g["images"].shape), bool(g["images"].min() >= 0), bool(g["images"].max() <= 1)
    ((3, 28, 28), True, True)
    """
    if batch < 1 or side < 4:
        raise ValueError(f"sample_glyphs: need batch >= 1 and side >= 4, got batch={batch}, side={side}")
    most = max(len(t) for t in DIGIT_TEMPLATES)
    table = torch.tensor([list(t) + [t[-1]] * (most - len(t)) for t in DIGIT_TEMPLATES])  # [10, V, 2]
    labels = torch.randint(0, 10, (batch,), generator=generator)

    def uniform(lo_hi):
        return torch.empty(batch).uniform_(*lo_hi, generator=generator)

    v = table[labels] + JITTER_STD * torch.randn(batch, most, 2, generator=generator)
    angle, shear, scale = uniform(ROTATION), uniform(SHEAR), uniform(SCALE)
    cos, sin = torch.cos(angle), torch.sin(angle)
    # rotate · shear · scale about the centre of the box, then shift
    m = torch.stack([torch.stack([cos, cos * shear - sin], -1), torch.stack([sin, sin * shear + cos], -1)], -2)
    m = m * scale.view(-1, 1, 1)
    shift = torch.stack([uniform(SHIFT), uniform(SHIFT)], -1)
    v = (v - 0.5) @ m.mT + 0.5 + shift[:, None]
    return {"images": render_polylines(v, uniform(HALF_WIDTH), side), "labels": labels}


def pixel_tasks(images, num_context: int, generator):
    """Image completion as regression: random observed pixels as context, every pixel as a target.

    Positions are the pixel centres scaled to [-1, 1]² (x = column, y = row); values are the intensities.

    Returns
    -------
    dict
        ``xc [B, N, 2], yc [B, N, 1]`` (``num_context`` pixels drawn without replacement per image),
        ``x [B, P, 2], y [B, P, 1]`` (all ``P = side²`` pixels in raster order) and ``index [B, N]``.
    """
    b, h, w = images.shape
    if not 1 <= num_context <= h * w:
        raise ValueError(f"pixel_tasks: need 1 <= num_context <= {h * w} pixels, got {num_context}")
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    pos = torch.stack([(cols.flatten() + 0.5) / w, (rows.flatten() + 0.5) / h], -1).to(images.dtype) * 2 - 1
    x, y = pos.expand(b, -1, -1), images.reshape(b, -1, 1)
    index = torch.rand(b, h * w, generator=generator).argsort(-1)[:, :num_context]
    return {"xc": x.gather(1, index[..., None].expand(-1, -1, 2)), "yc": y.gather(1, index[..., None]),
            "x": x, "y": y, "index": index}
