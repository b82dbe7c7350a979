"""Batches of Neural Process tasks: :class:`NPBatch` (every task with the same context and target counts, in
``[B, N, ·]`` tensors) and :class:`PackedNPBatch` (tasks with their own counts laid end to end, FlashAttention's
varlen layout, so that a batch mixing ``N_c = 3`` and ``N_c = 197`` pads nothing).

>>> import torch
>>> from attn_ext.data import GPSampler
>>> batch = GPSampler().sample_packed(3, generator=torch.Generator().manual_seed(0))
>>> batch.cu_seqlens_c.tolist() == [0, *torch.cumsum(batch.num_context, 0).tolist()]
True
>>> task = batch.task(1)                      # an NPBatch of one task
>>> task.xc.shape[1] == int(batch.num_context[1])
True
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor



class NPBatch(NamedTuple):
    """A batch of Neural Process tasks: ``xc [B, N_c, dx]``, ``yc [B, N_c, dy]``, ``xt [B, N_t, dx]``,
    ``yt [B, N_t, dy]``; every task of the batch has the same ``N_c`` and ``N_t``."""

    xc: Tensor
    yc: Tensor
    xt: Tensor
    yt: Tensor


class PackedNPBatch(NamedTuple):
    """``B`` tasks packed: ``xc [T_c, dx]``, ``yc [T_c, dy]``, ``xt [T_t, dx]``, ``yt [T_t, dy]`` with task ``b``'s
    context in rows ``cu_seqlens_c[b]:cu_seqlens_c[b + 1]`` and its targets in ``cu_seqlens_t[b]:cu_seqlens_t[b +
    1]`` (int32 ``[B + 1]``, from 0): the layout of :func:`attn_ext.varlen_attention`."""

    xc: Tensor
    yc: Tensor
    xt: Tensor
    yt: Tensor
    cu_seqlens_c: Tensor
    cu_seqlens_t: Tensor

    @property
    def batch_size(self) -> int:
        return self.cu_seqlens_c.numel() - 1

    @property
    def num_context(self) -> Tensor:
        """``[B]`` context counts."""
        return self.cu_seqlens_c.diff()

    @property
    def num_target(self) -> Tensor:
        """``[B]`` target counts."""
        return self.cu_seqlens_t.diff()

    def task(self, b: int) -> NPBatch:
        """Task ``b`` as an :class:`~attn_ext.data.NPBatch` of one."""
        c0, c1 = (int(i) for i in self.cu_seqlens_c[b:b + 2])
        t0, t1 = (int(i) for i in self.cu_seqlens_t[b:b + 2])
        return NPBatch(self.xc[None, c0:c1], self.yc[None, c0:c1], self.xt[None, t0:t1], self.yt[None, t0:t1])


def _offsets(counts: Sequence[int], device) -> Tensor:
    return torch.tensor([0, *counts], dtype=torch.int64, device=device).cumsum(0).to(torch.int32)


def pack_tasks(tasks: Sequence[NPBatch]) -> PackedNPBatch:
    """One :class:`PackedNPBatch` of ``tasks``, each an :class:`~attn_ext.data.NPBatch` (its tasks packed in
    order; a batch of several tasks contributes each of them)."""
    if not tasks:
        raise ValueError("pack_tasks: no tasks given")
    split = [NPBatch(*(t[i] for t in task)) for task in tasks for i in range(task.xc.shape[0])]
    device = split[0].xc.device
    return PackedNPBatch(torch.cat([t.xc for t in split]), torch.cat([t.yc for t in split]),
                         torch.cat([t.xt for t in split]), torch.cat([t.yt for t in split]),
                         _offsets([t.xc.shape[0] for t in split], device),
                         _offsets([t.xt.shape[0] for t in split], device))
