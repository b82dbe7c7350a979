"""``torch.func.vmap`` for the ops whose every tensor argument and result leads with the batch dimension.

Such an op is already batched over that dimension, so a vmapped call folds the vmapped dimension into
it — ``[V, B, ...] -> [V·B, ...]`` — runs the op once and unfolds the results, instead of PyTorch's
fall-back that runs the op once per vmapped element (and warns about it).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor


def _vmapped_size(args: Sequence, in_dims: Sequence[Optional[int]]) -> int:
    return next(a.shape[d] for a, d in zip(args, in_dims) if isinstance(a, Tensor) and d is not None)


def _fold(arg, in_dim: Optional[int], size: int):
    if not isinstance(arg, Tensor):
        return arg
    arg = arg.unsqueeze(0).expand(size, *arg.shape) if in_dim is None else arg.movedim(in_dim, 0)
    return arg.reshape(size * arg.shape[1], *arg.shape[2:])


def register_batch_folding_vmap(qualname: str) -> None:
    """Registers the folding rule of the module docstring as op ``qualname``'s batching rule."""
    op = getattr(torch.ops.attn_ext, qualname.split("::")[1]).default

    def rule(info, in_dims, *args):
        size = _vmapped_size(args, in_dims)
        results = op(*(_fold(a, d, size) for a, d in zip(args, in_dims)))
        single = isinstance(results, Tensor)
        unfolded = tuple(r.unflatten(0, (size, -1)) for r in ((results,) if single else results))
        return (unfolded[0], 0) if single else (unfolded, (0,) * len(unfolded))

    torch.library.register_vmap(qualname, rule)
