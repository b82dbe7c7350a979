"""The fused C++ kernel of Tree Cross Attention (attn_ext::tree_cross_attention_fwd) against the reference."""
import math

import pytest
import torch

import attn_ext as ae
from attn_ext.ops.tree import build_tree, tree_aggregate, tree_cross_attention
from attn_ext.ops.tree.naive import path_forward

pytestmark = pytest.mark.skipif(
    ae.available_backends(torch.zeros(1))["cpp"] is not None, reason="attn_ext._C is not built"
)

OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def setup(B=2, H=3, M=7, N=20, b=2, D=5, Dv=4, masked=False, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    mask = None
    if masked:
        mask = torch.rand(B, N, generator=g) < 0.4
        mask[:, -1] = False
    tree = build_tree(torch.rand(B, N, 1, generator=g, dtype=torch.float64), branching=b, key_padding_mask=mask)
    tokens = torch.randn(B, N, H * (D + Dv), generator=g, dtype=torch.float64)
    nodes = tree_aggregate(tree, tokens).view(B, tree.num_nodes, H, D + Dv).permute(0, 2, 1, 3)
    node_k, node_v = nodes[..., :D].to(dtype), nodes[..., D:].to(dtype)
    q = torch.randn(B, H, M, D, generator=g, dtype=torch.float64).to(dtype)
    return tree, q, node_k, node_v


def run(backend, tree, q, node_k, node_v, policy, seed=3, **kw):
    return tree_cross_attention(q, node_k, node_v, tree, policy=policy, backend=backend,
                                generator=torch.Generator().manual_seed(seed), **kw)


def assert_same(cpp, ref, tol):
    assert torch.equal(cpp.selected, ref.selected)
    assert cpp.out.dtype == ref.out.dtype and cpp.log_prob.dtype == ref.log_prob.dtype
    for name in ("out", "log_prob", "entropy"):
        torch.testing.assert_close(getattr(cpp, name), getattr(ref, name), rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("policy", ["greedy", "sample"])
@pytest.mark.parametrize("b", [2, 3, 4])
@pytest.mark.parametrize("N", [1, 7, 128, 513])
@pytest.mark.parametrize("masked", [False, True])
def test_cpp_equals_reference_float64(policy, b, N, masked):
    tree, q, node_k, node_v = setup(N=N, b=b, masked=masked and N > 1, seed=N * 10 + b)
    cpp = run("cpp", tree, q, node_k, node_v, policy)
    ref = run("reference", tree, q, node_k, node_v, policy)
    assert_same(cpp, ref, 1e-12)


@pytest.mark.parametrize("policy", ["greedy", "sample"])
@pytest.mark.parametrize("b,N,masked", [(2, 513, False), (3, 128, True), (4, 513, True), (2, 7, True)])
def test_cpp_equals_reference_float32(policy, b, N, masked):
    tree, q, node_k, node_v = setup(M=16, N=N, b=b, masked=masked, seed=N + b, dtype=torch.float32)
    assert_same(run("cpp", tree, q, node_k, node_v, policy), run("reference", tree, q, node_k, node_v, policy), 2e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpp_half_precision(dtype):
    tree, q, node_k, node_v = setup(N=64, masked=True, seed=4, dtype=dtype)
    cpp, ref = run("cpp", tree, q, node_k, node_v, "greedy"), run("reference", tree, q, node_k, node_v, "greedy")
    assert cpp.out.dtype == dtype and cpp.log_prob.dtype == torch.float32
    assert torch.equal(cpp.selected, ref.selected)
    torch.testing.assert_close(cpp.out.float(), ref.out.float(), rtol=0, atol=2 * torch.finfo(dtype).eps)
    torch.testing.assert_close(cpp.log_prob, ref.log_prob, rtol=1e-5, atol=1e-5)


def test_strided_inputs_and_scale():
    tree, q, node_k, node_v = setup(N=40, b=3, masked=True, seed=8, D=6)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous heads
    k_s = node_k[..., ::2]
    cpp = run("cpp", tree, q_t[..., ::2], k_s, node_v, "sample", scale=0.3)
    ref = run("reference", tree, q[..., ::2].contiguous(), k_s.contiguous(), node_v, "sample", scale=0.3)
    assert_same(cpp, ref, 1e-12)


@pytest.mark.parametrize("policy", ["greedy", "sample"])
@pytest.mark.parametrize("b,N,masked", [(2, 20, False), (3, 30, True), (4, 5, True)])
def test_gradients_equal_reference(policy, b, N, masked):
    tree, q, node_k, node_v = setup(B=2, H=2, M=3, N=N, b=b, masked=masked, seed=21 + N)
    grads = {}
    for backend in ("cpp", "reference"):
        inputs = tuple(t.detach().clone().requires_grad_() for t in (q, node_k, node_v))
        res = run(backend, tree, *inputs, policy)
        g = torch.Generator().manual_seed(0)
        w_out = torch.randn(res.out.shape, generator=g, dtype=res.out.dtype)
        loss = (res.out * w_out).sum() + 0.7 * res.log_prob.sum() - 0.3 * res.entropy.sum()
        grads[backend] = torch.autograd.grad(loss, inputs)
    for gc, gr in zip(grads["cpp"], grads["reference"]):
        torch.testing.assert_close(gc, gr, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("with_policy_grads", [False, True])
@pytest.mark.parametrize("b,N,D,Dv", [(2, 239, 40, 59), (16, 300, 8, 3), (3, 1, 4, 4)])
def test_gradients_float32_within_flash_rule(with_policy_grads, b, N, D, Dv):
    tree, q64, k64, v64 = setup(B=2, H=3, M=5, N=N, b=b, D=D, Dv=Dv, masked=N > 1, seed=31 + b)
    g = torch.Generator().manual_seed(1)
    w_out = torch.randn(2, 3, 5, Dv, generator=g, dtype=torch.float64)

    def loss_of(out, log_prob, entropy):
        loss = (out * w_out.to(out.dtype)).sum()
        return loss + 0.7 * log_prob.sum() - 0.3 * entropy.sum() if with_policy_grads else loss

    inputs = tuple(t.detach().float().requires_grad_() for t in (q64, k64, v64))
    res = run("cpp", tree, *inputs, "sample")
    ours = torch.autograd.grad(loss_of(res.out, res.log_prob, res.entropy), inputs)

    def reference_grads(dtype):  # the reference math on the same selected sets
        inputs = tuple(t.detach().to(dtype).requires_grad_() for t in (q64, k64, v64))
        out, _, log_prob, entropy = path_forward(*inputs, tree.node_padding_mask, res.selected, tree.branching,
                                                 tree.height, tree.group_size, 1 / math.sqrt(D))
        return torch.autograd.grad(loss_of(out, log_prob, entropy), inputs)

    exact, baseline = reference_grads(torch.float64), reference_grads(torch.float32)
    for name, e, o, r in zip(("dq", "dk", "dv"), exact, ours, baseline):
        err, ref_err = (o.double() - e).abs().max().item(), (r.double() - e).abs().max().item()
        assert err <= 3 * ref_err + 1e-6, f"{name}: {err} vs reference fp32 error {ref_err}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gradients_half_precision(dtype):
    tree, q64, k64, v64 = setup(N=64, masked=True, seed=4)

    def grads(backend, dt):
        inputs = tuple(t.detach().to(dt).requires_grad_() for t in (q64, k64, v64))
        res = run(backend, tree, *inputs, "greedy")
        loss = res.out.float().sum() + res.log_prob.sum() + res.entropy.sum()
        return torch.autograd.grad(loss, inputs)

    exact = grads("reference", torch.float64)
    for name, e, o, r in zip(("dq", "dk", "dv"), exact, grads("cpp", dtype), grads("reference", dtype)):
        assert o.dtype == dtype
        err, ref_err = (o.double() - e).abs().max().item(), (r.double() - e).abs().max().item()
        assert err <= 3 * ref_err + 4 * torch.finfo(dtype).eps, f"{name}: {err} vs {ref_err}"


def test_backward_is_deterministic():
    tree, q, node_k, node_v = setup(B=2, H=4, M=64, N=200, b=2, masked=True, seed=12, dtype=torch.float32)
    runs = []
    for _ in range(2):
        inputs = tuple(t.detach().clone().requires_grad_() for t in (q, node_k, node_v))
        res = run("cpp", tree, *inputs, "sample")
        runs.append(torch.autograd.grad(res.out.sum() + res.log_prob.sum(), inputs))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_gradcheck_cpp_with_a_fixed_path():
    tree, q, node_k, node_v = setup(B=1, H=2, M=2, N=9, b=3, D=2, Dv=2, masked=True, seed=5)
    inputs = tuple(t.detach().clone().requires_grad_() for t in (q, node_k, node_v))
    path = run("cpp", tree, *inputs, "greedy").selected

    def fn(q, node_k, node_v):
        res = run("cpp", tree, q, node_k, node_v, "greedy")
        assert torch.equal(res.selected, path)
        return res.out, res.log_prob, res.entropy

    assert torch.autograd.gradcheck(fn, inputs)


def _op_args(dtype=torch.float64, sample=False, masked=True):
    tree, q, node_k, node_v = setup(B=2, H=2, M=3, N=13, b=2, masked=masked, seed=2, dtype=dtype)
    uniforms = torch.rand(2, 3, tree.height, generator=torch.Generator().manual_seed(1), dtype=dtype) if sample \
        else None
    return (q, node_k, node_v, tree.node_padding_mask, tree.branching, tree.height, tree.group_size, 0.45,
            uniforms), tree


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sample", [False, True])
def test_opcheck_fused_op(dtype, sample):
    args, _ = _op_args(dtype, sample)
    for t in args[:3]:
        t.requires_grad_(True)
    torch.library.opcheck(torch.ops.attn_ext.tree_cross_attention_fwd, args, test_utils=OPCHECK_TESTS)


def test_opcheck_backward_op():
    args, tree = _op_args()
    out, lse, selected, log_prob, entropy = torch.ops.attn_ext.tree_cross_attention_fwd(*args)
    grads = (torch.randn_like(out), torch.randn_like(lse), torch.randn_like(log_prob), torch.randn_like(entropy))
    bwd_args = (*grads, *args[:4], selected, lse, *args[4:8])
    torch.library.opcheck(torch.ops.attn_ext.tree_cross_attention_bwd, bwd_args, test_utils=OPCHECK_TESTS)


def test_backward_op_rejects_bad_selected_ids():
    args, tree = _op_args()
    out, lse, selected, log_prob, entropy = torch.ops.attn_ext.tree_cross_attention_fwd(*args)
    grads = (torch.ones_like(out), torch.zeros_like(lse), torch.zeros_like(log_prob), torch.zeros_like(entropy))
    bad = selected.clone()
    bad[0, 0, 0] = tree.num_nodes
    with pytest.raises(RuntimeError, match="outside the tree's"):
        torch.ops.attn_ext.tree_cross_attention_bwd(*grads, *args[:4], bad, lse, *args[4:8])
    with pytest.raises(RuntimeError, match=r"selected must be int64 \[B, M, S\]"):
        torch.ops.attn_ext.tree_cross_attention_bwd(*grads, *args[:4], selected[:, :, 1:], lse, *args[4:8])
    with pytest.raises(RuntimeError, match=r"grad_out must be \[B, H, M, Dv\]"):
        torch.ops.attn_ext.tree_cross_attention_bwd(out[:, :1], *grads[1:], *args[:4], selected, lse, *args[4:8])


def test_fused_op_returns_lse_of_the_selected_set():
    args, tree = _op_args()
    q, node_k, node_v, pad = args[:4]
    out, lse, selected, _, _ = torch.ops.attn_ext.tree_cross_attention_fwd(*args)
    B, H, M, _ = q.shape
    for e in range(B):
        for h in range(H):
            for m in range(M):
                ids = [i for i in selected[e, m].tolist() if not bool(pad[e, i])]
                s = node_k[e, h, ids] @ q[e, h, m] * 0.45
                torch.testing.assert_close(lse[e, h, m], torch.logsumexp(s, 0), rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(out[e, h, m], torch.softmax(s, 0) @ node_v[e, h, ids], rtol=1e-12,
                                           atol=1e-12)


def test_full_policy_cpp_equals_reference():
    tree, q, node_k, node_v = setup(N=50, b=2, masked=True, seed=6)
    cpp, ref = run("cpp", tree, q, node_k, node_v, "full"), run("reference", tree, q, node_k, node_v, "full")
    assert torch.equal(cpp.selected, ref.selected)
    torch.testing.assert_close(cpp.out, ref.out, rtol=1e-12, atol=1e-12)


def test_compile_fused_path():
    tree, q, node_k, node_v = setup(N=30, seed=9, dtype=torch.float32)
    fn = torch.compile(lambda q, k, v: tree_cross_attention(q, k, v, tree, backend="cpp"), backend="eager",
                       fullgraph=True)
    assert torch.equal(fn(q, node_k, node_v).out, run("cpp", tree, q, node_k, node_v, "greedy").out)


def test_backend_selection():
    tree, q, node_k, node_v = setup(N=10)
    with pytest.raises(ValueError, match="unknown backend 'cuda_magic'; choose one of cpp, cuda, triton, reference"):
        tree_cross_attention(q, node_k, node_v, tree, backend="cuda_magic")
    with pytest.raises(RuntimeError, match="backend 'cuda' cannot run on cpu .*cuda: the CUDA kernels run on CUDA tensors, got cpu"):
        tree_cross_attention(q, node_k, node_v, tree, backend="cuda")
    with pytest.raises(RuntimeError, match="backend 'triton' cannot run on cpu torch.float64 inputs"):
        tree_cross_attention(q, node_k, node_v, tree, backend="triton")
    meta_tree = build_tree(torch.randn(2, 10, 1, device="meta"))
    qm = torch.randn(2, 3, 4, 5, device="meta")
    nodes = torch.randn(2, 3, meta_tree.num_nodes, 5, device="meta")
    with pytest.raises(RuntimeError, match="backend 'cpp' cannot run on meta"):
        tree_cross_attention(qm, nodes, nodes, meta_tree, backend="cpp")
    assert tree_cross_attention(qm, nodes, nodes, meta_tree).out.device.type == "meta"  # auto -> reference


def test_bad_inputs_of_the_fused_op_raise_clear_errors():
    args, tree = _op_args(sample=True)
    q, node_k, node_v, pad, b, k, P, scale, u = args
    op = torch.ops.attn_ext.tree_cross_attention_fwd
    cases = [
        ((q, node_k, node_v, pad, 1, k, P, scale, u), "branching must be >= 2"),
        ((q, node_k, node_v, pad, b, k, 0, scale, u), "group_size must be >= 1"),
        ((q, node_k, node_v, pad, b, k + 1, P, scale, None), r"node_k must be \[B, H, num_nodes, D\]"),
        ((q, node_k[:, :, 1:], node_v, pad, b, k, P, scale, u), r"node_k must be \[B, H, num_nodes, D\]"),
        ((q[0], node_k, node_v, pad, b, k, P, scale, u), "must be 4-D"),
        ((q.float(), node_k, node_v, pad, b, k, P, scale, u), "must share a floating dtype"),
        ((q, node_k, node_v, pad.long(), b, k, P, scale, u), "node_padding_mask must be bool"),
        ((q, node_k, node_v, pad[:, 1:], b, k, P, scale, u), r"node_padding_mask must be \[B, num_nodes\]"),
        ((q, node_k, node_v, pad, b, k, P, math.inf, u), "scale must be finite"),
        ((q, node_k, node_v, pad, b, k, P, scale, u[:, :, 1:]), r"uniforms must be \[B, M, height\]"),
        ((q, node_k, node_v, pad, b, k, P, scale, u.long()), "uniforms must be a floating tensor"),
    ]
    for bad, match in cases:
        with pytest.raises(RuntimeError, match=match):
            op(*bad)
