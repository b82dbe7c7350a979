"""Packed batches in the reference models: the checks, the per-task likelihood of a
:class:`~attn_ext.data.PackedNPBatch`, and the per-task prediction of a model without a fused packed path.

TNP-D, LBANP, CMANP, TransformerCA and Perceiver IO attend over a packed batch in one call per layer
(:func:`attn_ext.varlen_attention`); the other diagonal models (TETNP, PT-TETNP, ConvNP, HyperMixNP, IST, ReTreever, the
Intention and linear-attention TNPs: their attention or grid has no packed kernel) predict each task by one
:meth:`predict` call on views of its own rows (:func:`per_task_prediction`): the same numbers, no padding, one call
per task. The joint-covariance models and ReTreever's objective take each task alone (:func:`per_task`); a joint
covariance over packed targets is not formed (their ``predict_packed`` refuses).

A packed batch's loss is the mean over tasks of each task's mean negative log-likelihood per target, its metric
the ``[B]`` per-task means: for tasks of equal counts the padded batch's numbers, and otherwise no task weighs
more for having more targets.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.distributions import Normal

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


def per_task_prediction(model, xc: Tensor, yc: Tensor, xt: Tensor, cu_seqlens_c: Tensor,
                        cu_seqlens_t: Tensor) -> Normal:
    """``Normal`` over the packed targets ``[T_t, dim_y]``: ``model.predict`` on each task's rows alone (views, a
    batch of one), concatenated in the packed order."""
    oc, ot = cu_seqlens_c.tolist(), cu_seqlens_t.tolist()
    if len(oc) != len(ot) or len(oc) < 1:
        raise ValueError(f"{type(model).__name__}: cu_seqlens_c and cu_seqlens_t must both be [B + 1], got "
                         f"{tuple(cu_seqlens_c.shape)} and {tuple(cu_seqlens_t.shape)}")
    means, scales = [], []
    for b in range(len(oc) - 1):
        task = model.predict(xc[oc[b]:oc[b + 1]][None], yc[oc[b]:oc[b + 1]][None], xt[ot[b]:ot[b + 1]][None])
        means.append(task.loc[0]), scales.append(task.scale[0])
    if not means:  # no task: an empty prediction of the model's output width
        empty = xt.new_empty((0, model.config.dim_y))
        return Normal(empty, empty.clone(), validate_args=False)
    return Normal(torch.cat(means), torch.cat(scales), validate_args=False)


def per_task(model, batch: PackedNPBatch, method) -> Tensor:
    """``[B]``: ``method`` (the model's loss or metric of an ``NPBatch``) of each task of a packed batch alone, so
    that a packed batch's loss is the mean over tasks of each task's, as for the packed paths."""
    check_packed(model, batch)
    return torch.cat([method(batch.task(b)).reshape(1) for b in range(batch.batch_size)])


def task_log_likelihood(model, batch: PackedNPBatch) -> Tensor:
    """``[B]``: per task, the mean over its targets of ``log p(y_t)`` summed over y dims."""
    check_packed(model, batch)
    prediction = model.predict_packed(batch.xc, batch.yc, batch.xt, batch.cu_seqlens_c, batch.cu_seqlens_t)
    per_target = prediction.log_prob(batch.yt).sum(-1)
    counts = batch.cu_seqlens_t.diff().to(torch.int64)
    task_of = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    sums = per_target.new_zeros(counts.numel()).index_add(0, task_of, per_target)
    return sums / counts.to(sums.dtype)
