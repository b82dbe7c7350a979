"""``torch.func.vmap`` for the ops whose every tensor argument and result leads with the batch dimension.

Such an op is already batched over that dimension, so a vmapped call folds the vmapped dimension into
it — ``[V, B, ...] -> [V·B, ...]`` — runs the op once and unfolds the results, instead of PyTorch's
fall-back that runs the op once per vmapped element (and warns about it).

The one exception is a random seed (an argument named ``*_seed``, such as attention dropout's
``dropout_seed``): it is one value per call, not per batch entry, and the random stream it seeds is
indexed by the batch entry. Folding would give vmapped element ``v`` the stream of batch entries
``v·B ... v·B + B − 1``, so the masks would differ between elements even for ``randomness="same"``,
and a seed batched by ``randomness="different"`` (one per element) cannot be one call's seed at all.
A call with a seed therefore runs once per vmapped element, each with its own slice of the batched
arguments and its own seed (the one seed where it is not batched): element ``v`` is exactly the call
of that element alone, so the backward, which regenerates the mask from the same seed, matches it.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor


#: Arguments one call's batch entries share (no batch dimension): folding leaves them alone.
SHARED_ARGUMENTS = frozenset({"w1", "b1", "w2", "b2"})


def _vmapped_size(args: Sequence, in_dims: Sequence[Optional[int]]) -> int:
    return next(a.shape[d] for a, d in zip(args, in_dims) if isinstance(a, Tensor) and d is not None)


def _batch_size(args: Sequence, in_dims: Sequence[Optional[int]], unbatched: Sequence[int]) -> int:
    """The op's own batch size B (each result leads with V·B after folding; V may be 0)."""
    return next(a.shape[1 if d == 0 else 0]  # the logical dim 0, behind the vmapped dim if that leads
                for i, (a, d) in enumerate(zip(args, in_dims)) if isinstance(a, Tensor) and i not in unbatched)


def _fold(arg, in_dim: Optional[int], size: int):
    if not isinstance(arg, Tensor):
        return arg
    arg = arg.unsqueeze(0).expand(size, *arg.shape) if in_dim is None else arg.movedim(in_dim, 0)
    return arg.reshape(size * arg.shape[1], *arg.shape[2:])


def _element(arg, in_dim: Optional[int], index: int):
    return arg if in_dim is None or not isinstance(arg, Tensor) else arg.select(in_dim, index)


def seed_arguments(op) -> Tuple[int, ...]:
    """Positions of ``op``'s per-call random seeds (arguments named ``*_seed``)."""
    return tuple(i for i, a in enumerate(op._schema.arguments) if a.name.endswith("_seed"))


def register_batch_folding_vmap(qualname: str) -> None:
    """Registers the folding rule of the module docstring as op ``qualname``'s batching rule."""
    op = getattr(torch.ops.attn_ext, qualname.split("::")[1]).default
    seeds = seed_arguments(op)
    shared = tuple(i for i, a in enumerate(op._schema.arguments) if a.name in SHARED_ARGUMENTS)
    # The gradient of shared weights sums over the batch: folded, it would sum over the vmapped elements too.
    sums_over_batch = any(r.name in {f"grad_{n}" for n in SHARED_ARGUMENTS} for r in op._schema.returns)

    def per_element(size, in_dims, args):
        calls = [op(*(_element(a, d, i) for a, d in zip(args, in_dims))) for i in range(size)]
        if isinstance(calls[0], Tensor):
            return torch.stack(calls), 0
        return tuple(torch.stack(r) for r in zip(*calls)), (0,) * len(calls[0])

    def rule(info, in_dims, *args):
        size = _vmapped_size(args, in_dims)
        seeded = [i for i in seeds if isinstance(args[i], Tensor)]
        per_element_weights = any(in_dims[i] is not None for i in shared)
        if (seeded or per_element_weights or sums_over_batch) and size > 0:
            return per_element(size, in_dims, args)
        batch = _batch_size(args, in_dims, seeds + shared)
        # A seed is not folded (with no element any one-element seed gives the (empty) results), nor are shared
        # weights (batched ones only reach here with no element: any weights of one element's shape do).
        folded = tuple(a.new_zeros(1) if i in seeded else
                       (a if in_dims[i] is None else a.new_zeros(a.shape[:in_dims[i]] + a.shape[in_dims[i] + 1:]))
                       if i in shared else
                       _fold(a, d, size)
                       for i, (a, d) in enumerate(zip(args, in_dims)))
        results = op(*folded)
        single = isinstance(results, Tensor)
        unfolded = tuple(r.unflatten(0, (size, batch)) for r in ((results,) if single else results))
        return (unfolded[0], 0) if single else (unfolded, (0,) * len(unfolded))

    torch.library.register_vmap(qualname, rule)
