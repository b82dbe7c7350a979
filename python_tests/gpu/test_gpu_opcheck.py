"""``torch.library.opcheck`` of every op with a CUDA or Triton kernel, on CUDA tensors: schema, autograd
registration, fake kernel and AOT dispatch agree with the kernels that really run on the GPU. Skipped
without a CUDA device."""
import pytest
import torch

import attn_ext as ae
from attn_ext.ops.utils import dispatch
from _gpu import backends

OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("backend", backends())
def test_opcheck_cross_attention_and_merge(backend):
    q, k, v = (torch.randn(1, 2, n, 40, device="cuda", requires_grad=True) for n in (5, 9, 9))
    mask = torch.zeros(1, 9, dtype=torch.bool, device="cuda")
    mask[0, -2:] = True
    forward = dispatch.kernel("cross_attention", backend)
    torch.library.opcheck(forward, (q, k, v, mask, 0.2, 4), test_utils=OPCHECK_TESTS)
    with torch.no_grad():
        out, lse = forward(q, k, v, mask, 0.2, 4)
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    torch.library.opcheck(dispatch.backward_kernel("cross_attention", backend),
                          (grad_out, grad_lse, q.detach(), k.detach(), v.detach(), mask, out, lse, 0.2, 4),
                          test_utils=OPCHECK_TESTS)
    out_b, lse_b = torch.randn_like(out, requires_grad=True), torch.randn_like(lse, requires_grad=True)
    torch.library.opcheck(dispatch.kernel("merge_states", backend),
                          (out.detach().requires_grad_(True), lse.detach().requires_grad_(True), out_b, lse_b),
                          test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("backend", backends("tree_cross_attention"))
def test_opcheck_tree(backend):
    g = torch.Generator().manual_seed(0)
    B, H, M, N, D = 1, 2, 3, 20, 8
    tree = ae.build_tree(torch.rand(B, N, 1, generator=g), branching=2)
    tokens = torch.randn(B, N, H * 2 * D, generator=g)
    nodes = ae.tree_aggregate(tree, tokens).view(B, tree.num_nodes, H, 2 * D).permute(0, 2, 1, 3)
    q = torch.randn(B, H, M, D, generator=g)
    tree = tree.to("cuda")
    args = (q.cuda().requires_grad_(), nodes[..., :D].contiguous().cuda().requires_grad_(),
            nodes[..., D:].contiguous().cuda().requires_grad_(), tree.node_padding_mask, tree.branching, tree.height,
            tree.group_size, 0.3, None)
    torch.library.opcheck(dispatch.kernel("tree_cross_attention", backend), args, test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("backend", backends("intention"))
def test_opcheck_intention(backend):
    q, k, v = (torch.randn(1, 2, n, 8, device="cuda", requires_grad=True) for n in (4, 12, 12))
    alpha = torch.ones(1, 2, device="cuda", requires_grad=True)
    torch.library.opcheck(dispatch.kernel("intention", backend), (q, k, v, None, alpha, 1.0), test_utils=OPCHECK_TESTS)
