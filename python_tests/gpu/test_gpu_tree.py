"""Tree cross attention (forward, both policies, and backward) on CUDA tensors, ``backend="cuda"`` and
``backend="triton"``, and tree aggregation (``cuda`` only: it has no Triton kernel), against the C++
kernels on the CPU. The kernels are called as ops, with the ``"sample"`` policy's uniforms passed in, so
that both devices descend alike. Skipped without a CUDA device."""
import pytest
import torch

import attn_ext as ae
from attn_ext.ops.utils import dispatch
from _gpu import backends, grid


def _tree_problem(branching, B=2, H=4, M=9, N=300, D=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    tree = ae.build_tree(torch.rand(B, N, 1, generator=g), branching=branching)
    tokens = torch.randn(B, N, H * 2 * D, generator=g)
    nodes = ae.tree_aggregate(tree, tokens).view(B, tree.num_nodes, H, 2 * D).permute(0, 2, 1, 3)
    return tree, tokens, torch.randn(B, H, M, D, generator=g), nodes[..., :D].contiguous(), nodes[..., D:].contiguous()


def _op_args(tree, q, node_k, node_v, policy, device):
    """The op's arguments on ``device``; the uniforms of ``"sample"`` drawn once on the CPU, so that the CPU
    and GPU descents take the same paths (a generator draws differently on each device)."""
    uniforms = None
    if policy == "sample":
        uniforms = torch.rand(q.shape[0], q.shape[2], tree.height, generator=torch.Generator().manual_seed(1))
    tree = tree.to(device)
    moved = [None if t is None else t.detach().to(device) for t in (q, node_k, node_v, uniforms)]
    return (*moved[:3], tree.node_padding_mask, tree.branching, tree.height, tree.group_size, 0.3, moved[3])


@pytest.mark.parametrize("backend", backends("tree_cross_attention"))
@pytest.mark.parametrize("policy", ["greedy", "sample"])
@pytest.mark.parametrize("branching", grid([2, 4], [2]))
def test_tree_cross_attention_matches_cpu(backend, policy, branching):
    tree, _, q, node_k, node_v = _tree_problem(branching)
    expected = dispatch.kernel("tree_cross_attention", "cpp")(*_op_args(tree, q, node_k, node_v, policy, "cpu"))
    got = dispatch.kernel("tree_cross_attention", backend)(*_op_args(tree, q, node_k, node_v, policy, "cuda"))
    assert got[0].device.type == "cuda"
    assert torch.equal(got[2].cpu(), expected[2]), f"{backend}: other nodes selected than on the CPU"
    for name, ours, theirs in zip(("out", "lse", "selected", "log_prob", "entropy"), got, expected):
        if name != "selected":
            torch.testing.assert_close(ours.cpu(), theirs, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{backend} {n}: {m}")


@pytest.mark.parametrize("backend", backends("tree_cross_attention"))
@pytest.mark.parametrize("branching", grid([2, 3], [2]))
def test_tree_backward_matches_cpu(backend, branching):
    tree, _, q, node_k, node_v = _tree_problem(branching)
    grads = {}
    for name, device in (("cpp", "cpu"), (backend, "cuda")):
        args = list(_op_args(tree, q, node_k, node_v, "sample", device))
        leaves = [t.requires_grad_(True) for t in args[:3]]
        out, _, _, log_prob, entropy = dispatch.kernel("tree_cross_attention", name)(*leaves, *args[3:])
        loss = out.square().sum() + log_prob.sum() + 0.1 * entropy.sum()
        grads[device] = [g.cpu() for g in torch.autograd.grad(loss, leaves)]
    for label, ours, theirs in zip(("dq", "dk", "dv"), grads["cuda"], grads["cpu"]):
        torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-4, msg=lambda m, n=label: f"{backend} {n}: {m}")


@pytest.mark.parametrize("backend", backends("tree_aggregate", names=("cuda",)))
def test_tree_aggregate_matches_cpu(backend):
    tree, tokens, *_ = _tree_problem(2)
    leaves = [tokens.clone().requires_grad_(True), tokens.cuda().requires_grad_(True)]
    out_cpu = ae.tree_aggregate(tree, leaves[0], backend="cpp")
    out_gpu = ae.tree_aggregate(tree.to("cuda"), leaves[1], backend=backend)
    torch.testing.assert_close(out_gpu.cpu(), out_cpu, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(out_cpu)
    torch.testing.assert_close(torch.autograd.grad(out_gpu, leaves[1], g.cuda())[0].cpu(),
                               torch.autograd.grad(out_cpu, leaves[0], g)[0], rtol=1e-5, atol=1e-6)
