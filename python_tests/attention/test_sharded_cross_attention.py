"""``attn_ext.distributed.sharded_cross_attention`` on 2 gloo CPU processes vs one process.

All cases run in one ``torch.multiprocessing.spawn`` (process start-up dominates the cost): each
rank saves its outputs and gradients to ``tmp_path``; the parent compares them with a single-process
``ae.cross_attention`` over the full key set. A failing or hanging child fails the test: exceptions
propagate through ``ProcessContext.join`` and a deadline terminates stragglers.
"""
from __future__ import annotations

import datetime
import os
import time
from typing import Callable, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attn_ext as ae
from attn_ext import distributed as aed

WORLD = 2
DEADLINE_S = 120.0  # far above the ~5 s a healthy run takes; only there so that a hang cannot block CI
B, H, M, D, DV = 2, 3, 5, 8, 6

# name -> (shard sizes per rank, mask kind, chunk_size, backend)
CASES: Dict[str, tuple] = {
    "uneven_70_130": ((70, 130), None, None, None),
    "uneven_chunked": ((70, 130), "random", 16, None),
    "rank1_fully_padded": ((70, 130), "pad_rank1", None, None),
    "row_without_keys": ((70, 130), "pad_batch1", None, None),
    "rank1_no_keys": ((200, 0), "random", None, None),
}


def _case_inputs(name: str) -> dict:
    """The full (unsharded) inputs of a case, identical in every process (fixed seed)."""
    sizes, mask_kind, chunk_size, backend = CASES[name]
    n = sum(sizes)
    gen = torch.Generator().manual_seed(sorted(CASES).index(name))
    q = torch.randn(B, H, M, D, generator=gen)
    k = torch.randn(B, H, n, D, generator=gen) * 2.0  # peakier softmax than unit scores
    v = torch.randn(B, H, n, DV, generator=gen)
    mask = None
    if mask_kind == "random":
        mask = torch.rand(B, n, generator=gen) < 0.3
    elif mask_kind == "pad_rank1":  # rank 1's whole shard is padding; rank 0 partly padded
        mask = torch.rand(B, n, generator=gen) < 0.3
        mask[:, sizes[0]:] = True
    elif mask_kind == "pad_batch1":  # batch 1 has no valid key on any rank: out 0, lse -inf
        mask = torch.rand(B, n, generator=gen) < 0.3
        mask[1] = True
    g_out = torch.randn(B, H, M, DV, generator=gen)
    g_lse = torch.randn(B, H, M, generator=gen)
    return dict(q=q, k=k, v=v, mask=mask, g_out=g_out, g_lse=g_lse, sizes=sizes, chunk_size=chunk_size,
                backend=backend)


def _loss(out: torch.Tensor, lse: torch.Tensor, g_out: torch.Tensor, g_lse: torch.Tensor) -> torch.Tensor:
    lse_finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return (out * g_out).sum() + (lse_finite * g_lse).sum()


def _worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    """One rank: runs every case and saves ``{case: results}`` to ``out_dir/rank{rank}.pt``."""
    torch.set_num_threads(1)  # two ranks share the machine: avoid oversubscribing the cores
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        results = {}
        for name in CASES:
            c = _case_inputs(name)
            start = sum(c["sizes"][:rank])
            mine = slice(start, start + c["sizes"][rank])
            q = c["q"].clone().requires_grad_()
            k_local = c["k"][:, :, mine].clone().requires_grad_()
            v_local = c["v"][:, :, mine].clone().requires_grad_()
            mask = None if c["mask"] is None else c["mask"][:, mine]
            out, lse = aed.sharded_cross_attention(q, k_local, v_local, key_padding_mask=mask,
                                                   chunk_size=c["chunk_size"], backend=c["backend"])
            _loss(out, lse, c["g_out"], c["g_lse"]).backward()
            results[name] = dict(out=out.detach(), lse=lse.detach(), dq=q.grad, dk=k_local.grad, dv=v_local.grad)
        # check_shapes: agreeing ranks pass; a q shape differing between ranks raises on every rank.
        k_small, v_small = torch.randn(1, 2, 4 + rank, D), torch.randn(1, 2, 4 + rank, DV)
        aed.sharded_cross_attention(torch.zeros(1, 2, 3, D), k_small, v_small, check_shapes=True)
        try:
            aed.sharded_cross_attention(torch.zeros(1, 2, 3 + rank, D), k_small, v_small, check_shapes=True)
            results["mismatch_error"] = None
        except ValueError as e:
            results["mismatch_error"] = str(e)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _failing_worker(rank: int) -> None:
    # Rank 0 stands for a rank stuck in a collective whose peer died: it must be killed, not waited for.
    if rank == 0:
        time.sleep(DEADLINE_S)
    raise ValueError(f"deliberate failure on rank {rank}")


def run_ranks(fn: Callable, args: tuple, nprocs: int = WORLD, deadline_s: float = DEADLINE_S) -> None:
    """Spawn ``nprocs`` processes running ``fn(rank, *args)``; re-raise a child's failure, never hang."""
    context = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    stop = time.monotonic() + deadline_s
    try:
        while not context.join(timeout=1.0):  # raises ProcessRaisedException / ProcessExitedException
            if time.monotonic() > stop:
                raise TimeoutError(f"distributed workers did not finish within {deadline_s:.0f} s")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory) -> List[dict]:
    out_dir = tmp_path_factory.mktemp("sharded")
    # A file rendezvous in a fresh directory: no port to pick, so no race with other jobs for it.
    run_ranks(_worker, (WORLD, f"file://{out_dir / 'rendezvous'}", str(out_dir)))
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]


def _single_process(name: str) -> dict:
    c = _case_inputs(name)
    q, k, v = (c[n].clone().requires_grad_() for n in ("q", "k", "v"))
    out, lse = ae.cross_attention(q, k, v, key_padding_mask=c["mask"], chunk_size=c["chunk_size"],
                                  return_lse=True, backend=c["backend"])
    _loss(out, lse, c["g_out"], c["g_lse"]).backward()
    return dict(out=out.detach(), lse=lse.detach(), dq=q.grad, dk=k.grad, dv=v.grad, sizes=c["sizes"], mask=c["mask"])


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    # fp32, different summation order (merge tree vs one chunked pass): ~1e-6 relative to the magnitudes.
    finite = torch.isfinite(expected)
    scale = max(1.0, float(expected[finite].abs().max())) if bool(finite.any()) else 1.0
    torch.testing.assert_close(actual, expected, atol=1e-5 * scale, rtol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_single_process_on_every_rank(rank_results, name):
    ref = _single_process(name)
    for r in range(WORLD):
        got = rank_results[r][name]
        _assert_close(got["out"], ref["out"], f"rank {r} out")
        _assert_close(got["lse"], ref["lse"], f"rank {r} lse")
    # Every rank merges the same gathered states in the same order: bit-identical replicas.
    assert torch.equal(rank_results[0][name]["out"], rank_results[1][name]["out"])
    assert torch.equal(rank_results[0][name]["lse"], rank_results[1][name]["lse"])


@pytest.mark.parametrize("name", list(CASES))
def test_backward_q_full_and_kv_per_shard(rank_results, name):
    ref = _single_process(name)
    start = 0
    for r, size in enumerate(ref["sizes"]):
        got = rank_results[r][name]
        mine = slice(start, start + size)
        start += size
        _assert_close(got["dq"], ref["dq"], f"rank {r} dq")
        assert got["dk"].shape == (B, H, size, D) and got["dv"].shape == (B, H, size, DV)
        _assert_close(got["dk"], ref["dk"][:, :, mine], f"rank {r} dk")
        _assert_close(got["dv"], ref["dv"][:, :, mine], f"rank {r} dv")
        if ref["mask"] is not None:  # padded keys get exactly zero gradient
            padded = ref["mask"][:, mine]
            assert bool((got["dk"].permute(0, 2, 1, 3)[padded] == 0).all())
            assert bool((got["dv"].permute(0, 2, 1, 3)[padded] == 0).all())


def test_row_without_any_valid_key_gives_zero_out_minus_inf_lse_and_zero_grads(rank_results):
    for r in range(WORLD):
        got = rank_results[r]["row_without_keys"]
        assert bool((got["out"][1] == 0).all())
        assert bool(torch.isneginf(got["lse"][1]).all())
        assert bool((got["dq"][1] == 0).all())
        assert bool((got["dk"][1] == 0).all()) and bool((got["dv"][1] == 0).all())
        for t in got.values():
            assert not bool(torch.isnan(t).any())
        assert bool(torch.isfinite(got["lse"][0]).all())


def test_check_shapes_reports_mismatch_on_every_rank(rank_results):
    for r in range(WORLD):
        error = rank_results[r]["mismatch_error"]
        assert error is not None, f"rank {r} did not raise"
        assert f"rank 0: q {(1, 2, 3, D)}" in error and f"rank 1: q {(1, 2, 4, D)}" in error


def test_without_init_process_group_raises_clear_error():
    assert not dist.is_initialized()
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    with pytest.raises(RuntimeError, match="init_process_group"):
        aed.sharded_cross_attention(q, k, v)


def test_child_failure_fails_the_parent_without_waiting_for_the_others():
    start = time.monotonic()
    with pytest.raises(Exception, match="deliberate failure on rank 1"):
        run_ranks(_failing_worker, ())
    assert time.monotonic() - start < DEADLINE_S / 2
