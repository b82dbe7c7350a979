"""Context sharding over ``torch.distributed``: cross attention over keys spread across ranks (docs/spec.md §1).

Every rank holds the same queries and a shard of the keys. Each rank computes the attention state
``(out, lse)`` of the queries over its shard, the states are all-gathered with ``torch.distributed``
and merged (the state merge of :func:`attn_ext.merge_states`), which gives every rank the exact
attention over the union of the shards: sequence / context parallelism for fixed queries.

Demo (two CPU processes, gloo)::

    torchrun --nproc_per_node=2 -m attn_ext.distributed
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from attn_ext.ops.attention.state import AttentionState, merge_states, named_attention_state

#: The public name of :func:`sharded_cross_attention`, which its errors start with.
OP = "distributed.sharded_cross_attention"


def _check_initialised(group) -> Tuple[int, int]:
    """``(rank, world_size)`` of this process in ``group``; RuntimeError if there is no group to use."""
    if not dist.is_available():
        raise RuntimeError(f"attn_ext.{OP}: needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        raise RuntimeError(
            f"attn_ext.{OP}: needs an initialised torch.distributed process group; call "
            "torch.distributed.init_process_group(...) on every rank first (or launch with torchrun)"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise RuntimeError(f"attn_ext.{OP}: this process is not a member of the process group passed as `group`")
    return rank, dist.get_world_size(group)


def _check_same_everywhere(q: Tensor, v_local: Tensor, scale: Optional[float], world: int, group) -> None:
    mine = (tuple(q.shape), str(q.dtype), v_local.shape[-1] if v_local.dim() == 4 else None, scale)
    everyone: List[Optional[tuple]] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    if any(other != everyone[0] for other in everyone):
        listing = "; ".join(f"rank {r}: q {s[0]} {s[1]}, Dv {s[2]}, scale {s[3]}" for r, s in enumerate(everyone))
        raise ValueError(f"attn_ext.{OP}: needs the same q shape, dtype, Dv and scale on every "
                         f"rank; got {listing}")


def _gather(t: Tensor, world: int, group) -> List[Tensor]:
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


class _AllGatherStates(torch.autograd.Function):
    """All-gather of every rank's ``(out, lse)``; the backward of the replicated-output, mean-loss rule.

    Every rank merges the same gathered states, so rank ``j``'s state influences the loss of every
    rank. Under the convention "the loss is the mean over ranks of each rank's loss", the gradient
    of state ``j`` is the mean over ranks of what each rank's backward assigns to slot ``j``: one
    all-reduce (average) of all slots, of which this rank keeps its own.
    """

    @staticmethod
    def forward(ctx, group, rank: int, world: int, out: Tensor, lse: Tensor):
        ctx.group, ctx.rank, ctx.world = group, rank, world
        return (*_gather(out, world, group), *_gather(lse, world, group))

    @staticmethod
    def backward(ctx, *grads):
        # grads are materialised (zeros for unused slots), so every rank joins the same collectives.
        world, rank = ctx.world, ctx.rank
        grad_outs = torch.stack([g.contiguous() for g in grads[:world]])
        grad_lses = torch.stack([g.contiguous() for g in grads[world:]])
        for g in (grad_outs, grad_lses):
            # gloo has no ReduceOp.AVG, hence SUM followed by the division.
            dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group)
            g.div_(world)
        return None, None, None, grad_outs[rank], grad_lses[rank]


class _SumGradAcrossRanks(torch.autograd.Function):
    """Identity whose backward sums the gradient over ranks.

    Each rank's local attention only sees its shard of the keys, so its ``dq`` is that shard's
    contribution; the full ``dq`` is the sum of the contributions of all ranks.
    """

    @staticmethod
    def forward(ctx, group, q: Tensor) -> Tensor:
        ctx.group = group
        return q.view_as(q)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return None, grad


def sharded_cross_attention(
    q: Tensor,
    k_local: Tensor,
    v_local: Tensor,
    *,
    key_padding_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    chunk_size: Optional[int] = None,
    group: Optional["dist.ProcessGroup"] = None,
    backend: Optional[str] = None,
    check_shapes: bool = False,
) -> AttentionState:
    """Exact cross attention of ``q`` over keys sharded across the ranks of a process group.

    Each rank computes the state of ``q`` over its own shard (:func:`attn_ext.attention_state`),
    the states are all-gathered with ``torch.distributed.all_gather`` and merged in rank order as
    a balanced tree (:func:`attn_ext.merge_states`). Every rank gets the same, bit-identical
    ``(out, lse)``: the attention over the concatenation of the shards in rank order, equal to
    one :func:`attn_ext.cross_attention` over all keys within rounding (the merge order differs).
    Communication per call: two all-gathers of ``B·H·M·(Dv + 1)`` numbers per rank, independent
    of the number of keys.

    Parameters
    ----------
    q : Tensor
        Queries ``[B, H, M, D]``, the **same** on every rank (same shape, dtype and values).
    k_local : Tensor
        This rank's keys ``[B, H, N_r, D]``. ``N_r`` may differ between ranks and may be 0.
    v_local : Tensor
        This rank's values ``[B, H, N_r, Dv]``; ``Dv`` must be the same on every rank.
    key_padding_mask : Tensor, optional
        Bool ``[B, N_r]`` for this rank's keys, True = padding. A shard may be entirely padded; a
        query row with no valid key on any rank gets ``out = 0``, ``lse = -inf`` and zero gradients.
    scale : float, optional
        Score scale, default ``1 / sqrt(D)``; must be the same on every rank.
    chunk_size : int, optional
        Keys per chunk of the local attention (see :func:`attn_ext.cross_attention`).
    group : torch.distributed.ProcessGroup, optional
        The ranks sharing the keys; default the world group. Every rank of the group must call this
        function (it is a collective), with the same arguments apart from its shard
        (including which inputs require gradients).
    backend : str, optional
        Kernel backend of the local attention and of the merge (see :func:`attn_ext.cross_attention`).
        The collective backend is that of ``group`` (gloo on CPU, NCCL on CUDA).
    check_shapes : bool
        First verify, with one extra small collective, that every rank passes ``q`` of the same
        shape, dtype and ``Dv`` (and the same ``scale``); raises ``ValueError`` on every rank if not.
        Off by default, see the notes.

    Returns
    -------
    AttentionState
        ``(out [B, H, M, Dv], lse [B, H, M])``, replicated on every rank of ``group``.

    Raises
    ------
    RuntimeError
        If ``torch.distributed`` is not initialised or this process is not in ``group``.
    ValueError
        With ``check_shapes=True``, if the ranks disagree on the shape of ``q``, its dtype, ``Dv`` or ``scale``.

    Notes
    -----
    **Backward.** The loss is taken to be the *mean over ranks* of each rank's loss of the
    replicated output. When every rank computes the same loss from ``(out, lse)`` — the usual
    data/sequence-parallel case — gradients therefore equal those of a single process holding all
    keys: each rank receives exactly the gradients of its own ``k_local`` / ``v_local`` shard
    (the slices of the single-process ``dk``, ``dv``), and ``q.grad`` is the full gradient,
    identical on every rank (the shards' contributions are summed with an all-reduce).
    Consequences:

    * the backward pass runs collectives too, so every rank must backpropagate through the output
      (a rank whose loss ignores it must still include it, e.g. with weight 0), in the same order;
    * a parameter replicated on every rank that produces ``k_local`` / ``v_local`` (a key
      projection, say) gets only its own shard's contribution per rank: all-reduce its gradient with
      SUM over ``group`` to get the full one (averaging, as ``DistributedDataParallel`` does, scales
      it by ``1 / world_size``). Parameters producing ``q`` already get the full gradient everywhere.

    **Shape check.** By default the function does not verify that ``q`` and ``Dv`` agree across
    ranks, as that costs a collective per call. Mismatched shapes then break the ``all_gather``:
    with gloo one rank aborts (``gloo::EnforceNotMet ... Received data size doesn't match``) and the
    others see a connection error or hang until the group's timeout. Pass ``check_shapes=True``
    while debugging to get a ``ValueError`` naming each rank's shapes instead.

    Examples
    --------
    Run on every rank (e.g. under ``torchrun --nproc_per_node=2``), with ``q`` the same everywhere
    and the keys split between the ranks::

        dist.init_process_group("gloo")
        torch.manual_seed(0)  # same q, k, v on every rank
        q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 100, 8), torch.randn(1, 2, 100, 8)
        mine = slice(0, 30) if dist.get_rank() == 0 else slice(30, 100)
        out, lse = ae.distributed.sharded_cross_attention(q, k[:, :, mine], v[:, :, mine])
        assert torch.allclose(out, ae.cross_attention(q, k, v), atol=1e-6)
    """
    rank, world = _check_initialised(group)
    if check_shapes:
        _check_same_everywhere(q, v_local, scale, world, group)
    q_in = _SumGradAcrossRanks.apply(group, q)
    local = named_attention_state(OP, q_in, k_local, v_local, key_padding_mask, None, scale, chunk_size, backend)
    gathered = _AllGatherStates.apply(group, rank, world, local.out, local.lse)
    states = [AttentionState(gathered[i], gathered[world + i]) for i in range(world)]
    return merge_states(states, backend=backend)
