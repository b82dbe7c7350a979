"""Random problems of ``ae.te_attention`` for the tests: the nine tensors (the MLP's weights scaled so that the
logits spread over a few units, as a trained model's), a key padding mask, and the dense formula's results."""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from attn_ext.ops.te_attention import naive

NAMES = ("q", "k", "v", "xq", "xk", "w1", "b1", "w2", "b2")


def make_problem(B=2, H=2, M=5, N=9, D=4, Dv=3, dx=2, hidden=6, *, dtype=torch.float64, seed=0) -> List[Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, M, D), (B, H, N, D), (B, H, N, Dv), (B, M, dx), (B, N, dx), (hidden, H + dx), (hidden,),
              (H, hidden), (H,))
    scales = (1, 1, 1, 1, 1, (H + dx) ** -0.5, 0.5, max(hidden, 1) ** -0.5 * 2, 0.5)
    return [(torch.randn(s, generator=g, dtype=torch.float64) * c).to(dtype) for s, c in zip(shapes, scales)]


def make_mask(B: int, N: int, kind: str, seed: int = 1) -> Optional[Tensor]:
    """None, random padding, or random padding with batch entry 0 all padded."""
    if kind == "none":
        return None
    mask = torch.rand(B, N, generator=torch.Generator().manual_seed(seed)) < 0.3
    if kind == "one_entry_all_padded":
        mask[0] = True
    return mask


def dense(problem, mask=None, activation="relu", scale=None):
    return naive.dense(*problem, key_padding_mask=mask, scale=scale, activation=activation)
