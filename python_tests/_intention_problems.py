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
