"""The random float64 problems the Intention-variant tests share."""
import torch

F64 = torch.float64
BACKENDS = ["reference", "cpp"]


def problem(B=2, H=3, M=5, N=40, D=8, Dv=4, seed=0, masked=False):
    """``q [B, H, M, D]``, ``k [B, H, N, D]``, ``v [B, H, N, Dv]`` from ``seed`` and, with ``masked``, a padding
    mask with about 30 % of the keys padded (never key 0, so every row has a key)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, d, generator=g, dtype=F64) for n, d in ((M, D), (N, D), (N, Dv)))
    mask = None
    if masked:
        mask = torch.rand(B, N, generator=g) < 0.3
        mask[:, 0] = False
    return q, k, v, mask


def draw_problem(draw, *, min_keys: int, max_keys: int, max_dim: int):
    """For hypothesis strategies: ``(q, k, v, mask)`` in float64 with B, H <= 2, M <= 5,
    ``min_keys <= N <= max_keys``, any ``1 <= D <= max_dim``, ``1 <= Dv <= 5`` and, half the time, a
    padding mask that pads each key with a drawn probability up to 0.6 (whole rows included)."""
    from hypothesis import strategies as st

    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    M, N = draw(st.integers(1, 5)), draw(st.integers(min_keys, max_keys))
    D, Dv = draw(st.integers(1, max_dim)), draw(st.integers(1, 5))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q, k, v = (torch.randn(B, H, n, d, generator=g, dtype=F64) for n, d in ((M, D), (N, D), (N, Dv)))
    mask = torch.rand(B, N, generator=g) < draw(st.floats(0.0, 0.6)) if draw(st.booleans()) else None
    return q, k, v, mask
