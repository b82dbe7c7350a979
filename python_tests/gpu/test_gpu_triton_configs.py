"""Every tile config of the autotuned Triton kernels on CUDA, one at a time, at one shape.

``make gpu-check`` runs the GPU tests with ``ATTN_EXT_TRITON_PIN=1``: one config per kernel and call
instead of an autotuning sweep per shape (``attn_ext.ops.utils.triton.pinning``), so the other GPU tests
run one config of each kernel, and a config that the autotuner may pick elsewhere but that computes a
wrong result would go unseen. Here each config runs alone (an autotuner over that config only):

- cross attention forward and the backward's dK/dV and dQ kernels (the sdpa Triton backend's kernels
  too): fp16, D = Dv = 64, M = N = 136 (above every tile, so the size buckets prune none), a partial
  padding mask, against the fp64 ground truth with FlashAttention's accuracy rule. A config that the
  package's pruning drops on this card (its shared memory) is skipped, with that reason;
- the tree forward: each config that its launcher builds for one small tree, against the C++ kernel.

Skipped, with the reason, without a CUDA device (``pytest -rs``).
"""
import pytest
import torch

import attn_ext as ae
from attn_ext.ops.utils import dispatch
from _gpu import cuda, pytorch_grads_same_precision, pytorch_same_precision, unavailable
from _helpers import assert_within_flash_rule, backward_case, forward_case

triton = pytest.importorskip("triton")

from attn_ext.ops.attention import triton_bwd, triton_fwd, triton_tiles  # noqa: E402
from attn_ext.ops.tree import triton_fwd as tree_fwd  # noqa: E402

SHAPE = (1, 2, 136, 136, 64, 64)  # (B, H, M, N, D, Dv)
CHUNK = 128  # the chunk hint caps BLOCK_N: 128 keeps every tile
CONFIGS = triton_tiles._gpu_configs()


def _skip_reason(op: str):
    reason = unavailable("triton", op)
    return None if reason is None else f"triton backend not tested: {reason}"


def _only(config, kernel, key):
    """A factory like ``autotuned(kernel)``'s that launches ``kernel`` with ``config`` alone."""
    return lambda: triton.autotune(configs=[config], key=key)(kernel)


def _pruned_reason(config, q):
    """Why the package's pruning drops ``config`` for this case on this card, or None."""
    D, DV = q.shape[3], SHAPE[5]
    named = {"Q": q, "BLOCK_N_MAX": CHUNK, "M_BUCKET": triton_tiles._bucket(SHAPE[2]),
             "N_BUCKET": triton_tiles._bucket(SHAPE[3])}
    kept = triton_tiles._prune_configs(CONFIGS, named, BLOCK_D=triton_tiles.block_d(D), BLOCK_DV=triton_tiles.block_d(DV))
    if config in kept:
        return None
    return f"{config} exceeds this card's shared memory at fp16 D = 64 (the autotuner never runs it here)"


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=lambda i: "M{}_N{}_w{}_s{}".format(*triton_tiles._GPU_TILES[i]))
def test_cross_attention_config_forward_and_backward(index, monkeypatch):
    reason = _skip_reason("cross_attention")
    if reason:
        pytest.skip(reason)
    config = CONFIGS[index]
    key = triton_tiles._TUNE_KEY
    monkeypatch.setattr(triton_fwd, "_fwd_kernel_tuned", _only(config, triton_fwd._fwd_kernel, key))
    monkeypatch.setattr(triton_bwd, "_bwd_dkdv_tuned", _only(config, triton_bwd._bwd_dkdv, key))
    monkeypatch.setattr(triton_bwd, "_bwd_dq_tuned", _only(config, triton_bwd._bwd_dq, key))
    dtype = torch.float16
    q, k, v, mask, scale, refs = forward_case(*SHAPE, dtype, mask_kind="lengths")
    pruned = _pruned_reason(config, q.cuda())
    if pruned:
        pytest.skip(pruned)
    (out64, lse64), cpu_pt = refs
    out_pt, lse_pt = pytorch_same_precision(q, k, v, mask, scale, cpu_pt, (out64, lse64))
    qc, kc, vc, mc = cuda(q, k, v, mask)
    out, lse = ae.cross_attention(qc, kc, vc, key_padding_mask=mc, scale=scale, chunk_size=CHUNK, return_lse=True,
                                  backend="triton")
    assert_within_flash_rule(out.cpu(), out64, out_pt, name=f"{config} out")
    assert_within_flash_rule(lse.cpu(), lse64, lse_pt, name=f"{config} lse")

    q, k, v, mask, scale, grad_out, grad_lse, ref, cpu_pt = backward_case(*SHAPE, dtype, mask_kind="lengths")
    pt = pytorch_grads_same_precision(q, k, v, mask, scale, grad_out, grad_lse, cpu_pt, ref)
    leaves = [t.cuda().requires_grad_(True) for t in (q, k, v)]
    out, lse = ae.cross_attention(*leaves, key_padding_mask=mask.cuda(), scale=scale, chunk_size=CHUNK,
                                  return_lse=True, backend="triton")
    grads = torch.autograd.grad((out, lse), leaves, cuda(grad_out, grad_lse))
    for label, g, g64, gpt in zip(("dq", "dk", "dv"), grads, ref, pt):
        assert_within_flash_rule(g.cpu(), g64, gpt, grad=True, name=f"{config} {label}")


def _tree_problem(B=2, H=4, M=9, N=300, D=40, branching=2):
    g = torch.Generator().manual_seed(0)
    tree = ae.build_tree(torch.rand(B, N, 1, generator=g), branching=branching)
    tokens = torch.randn(B, N, H * 2 * D, generator=g)
    nodes = ae.tree_aggregate(tree, tokens).view(B, tree.num_nodes, H, 2 * D).permute(0, 2, 1, 3)
    q = torch.randn(B, H, M, D, generator=g)
    return tree, q, nodes[..., :D].contiguous(), nodes[..., D:].contiguous()


def _tree_configs():
    # The configs the launcher builds for _tree_problem(): block caps from M = 9, H = 4, D = Dv = 40.
    caps = tuple(tree_fwd._block_m_cap(9, 4, 64, w) for w in tree_fwd._WARPS)
    return tree_fwd.tree_configs(caps)


@pytest.mark.parametrize("index", range(len(_tree_configs())))
def test_tree_forward_config(index, monkeypatch):
    reason = _skip_reason("tree_cross_attention")
    if reason:
        pytest.skip(reason)
    config = _tree_configs()[index]
    monkeypatch.setattr(tree_fwd, "_tuned_kernel", lambda caps: triton.autotune(
        configs=[config], key=["H", "D", "DV", "height", "group_size"])(tree_fwd._tree_fwd_kernel))
    tree, q, node_k, node_v = _tree_problem()

    def args(device):
        t = tree.to(device)
        return (q.to(device), node_k.to(device), node_v.to(device), t.node_padding_mask, t.branching, t.height,
                t.group_size, 0.3, None)

    expected = dispatch.kernel("tree_cross_attention", "cpp")(*args("cpu"))
    got = dispatch.kernel("tree_cross_attention", "triton")(*args("cuda"))
    assert torch.equal(got[2].cpu(), expected[2]), f"{config}: other nodes selected than on the CPU"
    for name, ours, theirs in zip(("out", "lse", "selected", "log_prob", "entropy"), got, expected):
        if name != "selected":
            torch.testing.assert_close(ours.cpu(), theirs, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{config} {n}: {m}")
