"""Packed batches in the reference models: the checks and the per-task likelihood of a
:class:`~attn_ext.data.PackedNPBatch`, for a model with a ``predict_packed`` (TNP-D).

A packed batch's loss is the mean over tasks of each task's mean negative log-likelihood per target, its metric
the ``[B]`` per-task means: for tasks of equal counts the padded batch's numbers, and otherwise no task weighs
more for having more targets.
"""
from __future__ import annotations

import torch
from torch import Tensor

from attn_ext.data.batch import PackedNPBatch


def check_packed(model, batch: PackedNPBatch) -> None:
    """``ValueError`` naming the shapes unless x are ``[T, dim_x]``, y ``[T, dim_y]`` with the rows the offsets
    say, and every task has a target."""
    name, cfg = type(model).__name__, model.config
    for arg, t, width in (("xc", batch.xc, cfg.dim_x), ("yc", batch.yc, cfg.dim_y), ("xt", batch.xt, cfg.dim_x),
                          ("yt", batch.yt, cfg.dim_y)):
        if not isinstance(t, Tensor) or t.dim() != 2 or t.shape[-1] != width:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name}: a packed batch's {arg} must be [T, {width}], got {got}")
    for arg, x, y, offsets in (("context", batch.xc, batch.yc, batch.cu_seqlens_c),
                               ("target", batch.xt, batch.yt, batch.cu_seqlens_t)):
        if offsets.dim() != 1 or offsets.numel() != batch.cu_seqlens_c.numel() or offsets.numel() < 2:
            raise ValueError(f"{name}: cu_seqlens_c and cu_seqlens_t must both be [B + 1] with B >= 1, got "
                             f"{tuple(batch.cu_seqlens_c.shape)} and {tuple(batch.cu_seqlens_t.shape)}")
        if not x.shape[0] == y.shape[0] == int(offsets[-1]):
            raise ValueError(f"{name}: the {arg} offsets end at {int(offsets[-1])} but x{arg[0]} has {x.shape[0]} "
                             f"rows and y{arg[0]} {y.shape[0]}")
    if bool((batch.cu_seqlens_t.diff() <= 0).any()):
        raise ValueError(f"{name}: every task of a packed batch needs a target (a task's likelihood is a mean "
                         f"over its targets); target counts {batch.cu_seqlens_t.diff().tolist()}")


def task_log_likelihood(model, batch: PackedNPBatch) -> Tensor:
    """``[B]``: per task, the mean over its targets of ``log p(y_t)`` summed over y dims."""
    check_packed(model, batch)
    prediction = model.predict_packed(batch.xc, batch.yc, batch.xt, batch.cu_seqlens_c, batch.cu_seqlens_t)
    per_target = prediction.log_prob(batch.yt).sum(-1)
    counts = batch.cu_seqlens_t.diff().to(torch.int64)
    task_of = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    sums = per_target.new_zeros(counts.numel()).index_add(0, task_of, per_target)
    return sums / counts.to(sums.dtype)
