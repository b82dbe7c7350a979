"""``attn_ext.distributed``: keys sharded over ``torch.distributed`` ranks (docs/spec.md §1 "Distributed").

The op lives in :mod:`attn_ext.ops.attention.sharded`; this module is its public name and the demo
``torchrun --nproc_per_node=2 -m attn_ext.distributed`` (2 CPU processes over gloo, max error vs one process).
"""
from __future__ import annotations

import math
import os
from typing import List, Optional

import torch
import torch.distributed as dist

from attn_ext.ops.attention import cross_attention
from attn_ext.ops.attention.sharded import sharded_cross_attention

__all__ = ["sharded_cross_attention"]


def _split_sizes(n: int, world: int) -> List[int]:
    """Deliberately uneven shard sizes summing to ``n`` (rank ``r`` gets a share growing with ``r``)."""
    weights = [r + 1 for r in range(world)]
    sizes = [n * w // sum(weights) for w in weights]
    sizes[-1] += n - sum(sizes)
    return sizes


def _demo() -> None:
    """``torchrun --nproc_per_node=N -m attn_ext.distributed``: compare sharded and single-process attention."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit("run this demo under torchrun, e.g.: torchrun --nproc_per_node=2 -m attn_ext.distributed")
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        # Same seed on every rank: q and the full key set are identical everywhere; each rank keeps a slice.
        torch.manual_seed(0)
        B, H, M, N, D, Dv = 2, 4, 16, 10_000, 32, 24
        q = torch.randn(B, H, M, D, requires_grad=True)
        k, v = torch.randn(B, H, N, D), torch.randn(B, H, N, Dv)
        mask = torch.rand(B, N) < 0.1
        g_out, g_lse = torch.randn(B, H, M, Dv), torch.randn(B, H, M)
        sizes = _split_sizes(N, world)
        start = sum(sizes[:rank])
        mine = slice(start, start + sizes[rank])
        k_local = k[:, :, mine].clone().requires_grad_()
        v_local = v[:, :, mine].clone().requires_grad_()

        out, lse = sharded_cross_attention(q, k_local, v_local, key_padding_mask=mask[:, mine])
        ((out * g_out).sum() + (lse * g_lse).sum()).backward()
        dq_sharded = q.grad.clone()
        q.grad = None

        k_full, v_full = k.clone().requires_grad_(), v.clone().requires_grad_()
        out_ref, lse_ref = cross_attention(q, k_full, v_full, key_padding_mask=mask, return_lse=True)
        ((out_ref * g_out).sum() + (lse_ref * g_lse).sum()).backward()
        err = {
            "out": (out - out_ref).abs().max().item(),
            "lse": (lse - lse_ref).abs().max().item(),
            "dq": (dq_sharded - q.grad).abs().max().item(),
            "dk": (k_local.grad - k_full.grad[:, :, mine]).abs().max().item(),
            "dv": (v_local.grad - v_full.grad[:, :, mine]).abs().max().item(),
        }
        # Rank 0 prints everyone's errors: each rank checks the gradients of its own shard.
        errors: List[Optional[dict]] = [None] * world
        dist.all_gather_object(errors, err)
        if rank == 0:
            print(f"attn_ext sharded cross attention: {world} ranks (gloo), B={B} H={H} M={M} N={N} D={D} Dv={Dv}, "
                  f"keys per rank {sizes}")
            for r, e in enumerate(errors):
                print(f"  rank {r}: max |sharded - single process|  " + "  ".join(f"{n} {x:.2e}" for n, x in e.items()))
            worst = max(x for e in errors for x in e.values())
            print("OK" if math.isfinite(worst) and worst < 1e-4 else "MISMATCH")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _demo()
