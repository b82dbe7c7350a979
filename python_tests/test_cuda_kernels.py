"""The hand-written CUDA kernels (``backend="cuda"``, csrc/cuda) against the fp64 references.

The same cases and tolerances as the CPU and Triton tests: the FlashAttention rule for attention
(out, lse, and 3x for gradients), odd head dims, asymmetric lengths, N = 1, fully padded rows,
non-contiguous inputs, fp16/bf16/fp32; the tree and Intention ops against their C++ kernels on the
CPU; ``opcheck`` on every op with a CUDA kernel.

These tests need a CUDA device and an attn_ext built against a CUDA build of torch. Without them the
whole module is skipped and says why (run pytest with ``-rs`` to see it). As of this writing they
have never run: the project's machines have no GPU (see the README, "CUDA kernels").
"""
import pytest
import torch

import attn_ext as ae
from _helpers import assert_within_flash_rule, backward_case, forward_case, fully_padded_entries


def _cuda_unavailable_reason():
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False): the CUDA kernels are compile-checked only"
    return ae.available_backends(torch.zeros(1, device="cuda"))["cuda"]


_REASON = _cuda_unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"CUDA kernels not tested: {_REASON}")

OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SHAPES = [  # (B, H, M, N, D, Dv)
    (2, 3, 1, 239, 40, 40),
    (1, 2, 113, 203, 59, 59),
    (2, 2, 17, 1, 96, 64),
    (1, 1, 64, 300, 128, 128),
    (1, 2, 33, 77, 256, 256),
]


def _cuda(*tensors):
    return tuple(None if t is None else t.cuda() for t in tensors)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mask_kind", ["none", "all_padded", "lengths"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_forward_flash_rule(dtype, shape, mask_kind, layout):
    q, k, v, mask, scale, refs = forward_case(*shape, dtype, layout=layout, mask_kind=mask_kind)
    (out64, lse64), (out_pt, lse_pt) = refs
    qc, kc, vc, mc = _cuda(q, k, v, mask)
    out, lse = ae.cross_attention(qc, kc, vc, key_padding_mask=mc, scale=scale, return_lse=True, backend="cuda")
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_within_flash_rule(out.cpu(), out64, out_pt, name="cuda out")
    assert_within_flash_rule(lse.cpu(), lse64, lse_pt, name="cuda lse")
    for b in fully_padded_entries(mask):
        assert bool((out[b] == 0).all()) and bool(torch.isneginf(lse[b]).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES[:4], ids=str)
@pytest.mark.parametrize("mask_kind", ["none", "all_padded"])
def test_backward_flash_rule(dtype, shape, mask_kind):
    q, k, v, mask, scale, grad_out, grad_lse, ref, pt = backward_case(*shape, dtype, mask_kind=mask_kind)
    leaves = [t.cuda().requires_grad_(True) for t in (q, k, v)]
    mc = None if mask is None else mask.cuda()
    out, lse = ae.cross_attention(*leaves, key_padding_mask=mc, scale=scale, return_lse=True, backend="cuda")
    grads = torch.autograd.grad((out, lse), leaves, (grad_out.cuda(), grad_lse.cuda()))
    for label, g, g64, gpt in zip(("dq", "dk", "dv"), grads, ref, pt):
        assert_within_flash_rule(g.cpu(), g64, gpt, grad=True, name=f"cuda {label}")


def test_merge_states_matches_cpu():
    g = torch.Generator().manual_seed(0)
    out_a, out_b = torch.randn(2, 3, 5, 7, generator=g), torch.randn(2, 3, 5, 7, generator=g)
    lse_a, lse_b = torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g)
    lse_b[0, 0, 0] = lse_a[0, 0, 0] = float("-inf")  # the (−inf) − (−inf) guard
    expected = torch.ops.attn_ext.merge_states_fwd(out_a, lse_a, out_b, lse_b)
    got = torch.ops.attn_ext.merge_states_fwd(*_cuda(out_a, lse_a, out_b, lse_b))
    for x, y in zip(got, expected):
        torch.testing.assert_close(x.cpu(), y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_states_backward_matches_cpu(dtype):
    g = torch.Generator().manual_seed(1)
    out_a, out_b, grad_out = (torch.randn(2, 3, 5, 7, generator=g).to(dtype) for _ in range(3))
    lse_a, lse_b, grad_lse = (torch.randn(2, 3, 5, generator=g) for _ in range(3))
    lse_b[0, 0, 0] = lse_a[0, 0, 0] = float("-inf")  # an empty merged row: zero gradients, not NaN
    out, lse = torch.ops.attn_ext.merge_states_fwd(out_a, lse_a, out_b, lse_b)
    args = (grad_out, grad_lse, out_a, lse_a, out_b, lse_b, out, lse)
    expected = torch.ops.attn_ext.merge_states_bwd(*args)
    got = torch.ops.attn_ext.merge_states_bwd(*_cuda(*args))
    for x, y in zip(got, expected):
        assert x.dtype == y.dtype and not bool(x.isnan().any())
        torch.testing.assert_close(x.cpu().float(), y.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_states_merge_to_full_attention(dtype):
    """attention_state over two key halves + merge_states on CUDA equals one pass over all keys."""
    q, k, v, mask, scale, refs = forward_case(2, 2, 33, 150, 64, 40, dtype, layout="contiguous", mask_kind="lengths")
    (out64, lse64), (out_pt, lse_pt) = refs
    qc, kc, vc, mc = _cuda(q, k, v, mask)
    halves = [ae.attention_state(qc, kc[:, :, sl], vc[:, :, sl], key_padding_mask=None if mc is None else mc[:, sl],
                                 scale=scale, backend="cuda") for sl in (slice(0, 70), slice(70, None))]
    merged = ae.merge_states(halves, backend="cuda")
    assert_within_flash_rule(merged.out.cpu(), out64, out_pt, name="cuda merged out")
    assert_within_flash_rule(merged.lse.cpu(), lse64, lse_pt, name="cuda merged lse")


@pytest.mark.parametrize("policy", ["greedy", "sample"])
@pytest.mark.parametrize("branching", [2, 4])
def test_tree_cross_attention_matches_cpu(policy, branching):
    g = torch.Generator().manual_seed(0)
    B, H, M, N, D = 2, 4, 9, 300, 40
    tree = ae.build_tree(torch.rand(B, N, 1, generator=g), branching=branching)
    tokens = torch.randn(B, N, H * 2 * D, generator=g)
    nodes = ae.tree_aggregate(tree, tokens).view(B, tree.num_nodes, H, 2 * D).permute(0, 2, 1, 3)
    node_k, node_v = nodes[..., :D].contiguous(), nodes[..., D:].contiguous()
    q = torch.randn(B, H, M, D, generator=g)
    cpu = ae.tree_cross_attention(q, node_k, node_v, tree, policy=policy, backend="cpp",
                                  generator=torch.Generator().manual_seed(1))
    gpu = ae.tree_cross_attention(q.cuda(), node_k.cuda(), node_v.cuda(), tree.to("cuda"), policy=policy,
                                  backend="cuda", generator=torch.Generator().manual_seed(1))
    assert torch.equal(gpu.selected.cpu(), cpu.selected)
    torch.testing.assert_close(gpu.out.cpu(), cpu.out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gpu.log_prob.cpu(), cpu.log_prob, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("D", [8, 40, 64, 128])
@pytest.mark.parametrize("masked", [False, True])
def test_intention_matches_cpu(D, masked):
    g = torch.Generator().manual_seed(D)
    q, k, v = (torch.randn(2, 3, n, D, generator=g) for n in (11, 257, 257))
    mask = (torch.rand(2, 257, generator=g) < 0.3) if masked else None
    expected = ae.intention(q, k, v, alpha=0.5, key_padding_mask=mask, backend="cpp")
    got = ae.intention(*_cuda(q, k, v), alpha=0.5, key_padding_mask=None if mask is None else mask.cuda(),
                       backend="cuda")
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [7, 40, 64, 128])
def test_batched_cholesky_matches_torch(n):
    g = torch.Generator().manual_seed(n)
    z = torch.randn(64, n, n, generator=g, dtype=torch.float64)
    a = (z @ z.mT / n + torch.eye(n, dtype=torch.float64)).float().cuda()
    b = torch.randn(64, n, 5, generator=g).cuda()
    L, info = torch.ops.attn_ext.batched_cholesky(a)
    assert int(info.abs().sum()) == 0
    torch.testing.assert_close(L, torch.linalg.cholesky(a), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.ops.attn_ext.batched_cholesky_solve(L, b), torch.cholesky_solve(b, L),
                               rtol=1e-3, atol=1e-4)


def test_opcheck_attention_ops():
    q, k, v = (torch.randn(1, 2, n, 40, device="cuda", requires_grad=True) for n in (5, 9, 9))
    mask = torch.zeros(1, 9, dtype=torch.bool, device="cuda")
    torch.library.opcheck(torch.ops.attn_ext.cross_attention_fwd.default, (q, k, v, mask, 0.2, 4),
                          test_utils=OPCHECK_TESTS)
    with torch.no_grad():
        out, lse = torch.ops.attn_ext.cross_attention_fwd(q, k, v, mask, 0.2, 4)
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    torch.library.opcheck(torch.ops.attn_ext.cross_attention_bwd.default,
                          (grad_out, grad_lse, q.detach(), k.detach(), v.detach(), mask, out, lse, 0.2, 4),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    out_b, lse_b = torch.randn_like(out, requires_grad=True), torch.randn_like(lse, requires_grad=True)
    torch.library.opcheck(torch.ops.attn_ext.merge_states_fwd.default,
                          (out.detach().requires_grad_(True), lse.detach().requires_grad_(True), out_b, lse_b),
                          test_utils=OPCHECK_TESTS)


def _tree_problem(branching, B=2, H=4, M=9, N=300, D=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    tree = ae.build_tree(torch.rand(B, N, 1, generator=g), branching=branching)
    tokens = torch.randn(B, N, H * 2 * D, generator=g)
    nodes = ae.tree_aggregate(tree, tokens).view(B, tree.num_nodes, H, 2 * D).permute(0, 2, 1, 3)
    return tree, tokens, torch.randn(B, H, M, D, generator=g), nodes[..., :D].contiguous(), nodes[..., D:].contiguous()


@pytest.mark.parametrize("branching", [2, 3])
def test_tree_backward_matches_cpu(branching):
    tree, _, q, node_k, node_v = _tree_problem(branching)
    grads = {}
    for backend, device in (("cpp", "cpu"), ("cuda", "cuda")):
        leaves = [t.to(device).requires_grad_(True) for t in (q, node_k, node_v)]
        res = ae.tree_cross_attention(*leaves, tree.to(device), policy="sample", backend=backend,
                                      generator=torch.Generator().manual_seed(1))
        loss = res.out.square().sum() + res.log_prob.sum() + 0.1 * res.entropy.sum()
        grads[backend] = [g.cpu() for g in torch.autograd.grad(loss, leaves)]
    for ours, theirs in zip(grads["cuda"], grads["cpp"]):
        torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-4)


def test_tree_aggregate_matches_cpu():
    tree, tokens, *_ = _tree_problem(2)
    leaves = [tokens.clone().requires_grad_(True), tokens.cuda().requires_grad_(True)]
    out_cpu = ae.tree_aggregate(tree, leaves[0], backend="cpp")
    out_gpu = ae.tree_aggregate(tree.to("cuda"), leaves[1], backend="cuda")
    torch.testing.assert_close(out_gpu.cpu(), out_cpu, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(out_cpu)
    torch.testing.assert_close(torch.autograd.grad(out_gpu, leaves[1], g.cuda())[0].cpu(),
                               torch.autograd.grad(out_cpu, leaves[0], g)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("masked", [False, True])
def test_intention_backward_matches_cpu(masked):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, n, 40, generator=g) for n in (11, 130, 130))
    mask = (torch.rand(2, 130, generator=g) < 0.3) if masked else None
    alpha = torch.tensor([0.5, 1.0, 2.0])
    grads = {}
    for backend, device in (("cpp", "cpu"), ("cuda", "cuda")):
        leaves = [t.to(device).requires_grad_(True) for t in (q, k, v, alpha)]
        m = None if mask is None else mask.to(device)
        out = ae.intention(*leaves[:3], alpha=leaves[3], key_padding_mask=m, backend=backend)
        sig = ae.sigma_intention(*leaves[:3], alpha=leaves[3], key_padding_mask=m, backend=backend)
        grads[backend] = [x.cpu() for x in torch.autograd.grad(out.sum() + sig.square().sum(), leaves)]
    for ours, theirs in zip(grads["cuda"], grads["cpp"]):
        torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-4)


def test_spd_solve_on_cuda():
    z = torch.randn(16, 40, 40, dtype=torch.float64)
    a = (z @ z.mT / 40 + torch.eye(40, dtype=torch.float64)).float().cuda()
    b = torch.randn(16, 40, 3).cuda()
    torch.testing.assert_close(ae.batched_spd_solve(a, b), torch.linalg.solve(a, b), rtol=1e-3, atol=1e-4)


def test_opcheck_tree_and_intention_ops():
    tree, _, q, node_k, node_v = _tree_problem(2, B=1, H=2, M=3, N=20, D=8)
    tree = tree.to("cuda")
    args = (q.cuda().requires_grad_(), node_k.cuda().requires_grad_(), node_v.cuda().requires_grad_(),
            tree.node_padding_mask, tree.branching, tree.height, tree.group_size, 0.3, None)
    torch.library.opcheck(torch.ops.attn_ext.tree_cross_attention_fwd.default, args, test_utils=OPCHECK_TESTS)
    qi, ki, vi = (torch.randn(1, 2, n, 8, device="cuda", requires_grad=True) for n in (4, 12, 12))
    alpha = torch.ones(1, 2, device="cuda", requires_grad=True)
    torch.library.opcheck(torch.ops.attn_ext.intention_fwd.default, (qi, ki, vi, None, alpha, 1.0),
                          test_utils=OPCHECK_TESTS)
