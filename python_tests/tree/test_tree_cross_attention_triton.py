"""The Triton Tree Cross Attention kernels (attn_ext/triton/tree_cross_attention*.py) against the C++ op,
the reference and autograd through ``path_forward``. Run in the Triton interpreter on CPU: small trees."""
import math

import pytest
import torch

import attn_ext as ae
from attn_ext.ops.utils.triton import triton_unavailable_reason
from attn_ext.ops.tree import build_tree, tree_aggregate, tree_cross_attention
from attn_ext.ops.tree.naive import _attend, _attend_gathered, _gather_nodes, path_forward
from attn_ext.ops.tree.retrieval import _draw_uniforms

from _helpers import assert_within_flash_rule

_REASON = triton_unavailable_reason(torch.device("cpu"))
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"Triton unavailable: {_REASON}")

if _REASON is None:
    from attn_ext.ops.tree.triton_fwd import tree_cross_attention_fwd_triton
    from attn_ext.ops.tree.triton_bwd import tree_cross_attention_bwd_triton

needs_cpp = pytest.mark.skipif(ae.available_backends(torch.zeros(1))["cpp"] is not None,
                               reason="attn_ext._C is not built")


def setup(B=2, H=3, M=13, N=40, b=2, D=40, Dv=59, masked=True, seed=0, dtype=torch.float32):
    """A tree over N random points with mean-aggregated node keys/values and random queries."""
    g = torch.Generator().manual_seed(seed)
    mask = None
    if masked and N > 1:
        mask = torch.rand(B, N, generator=g) < 0.4
        mask[:, -1] = False
    tree = build_tree(torch.rand(B, N, 1, generator=g, dtype=torch.float64), branching=b, key_padding_mask=mask)
    tokens = torch.randn(B, N, H * (D + Dv), generator=g, dtype=torch.float64)
    nodes = tree_aggregate(tree, tokens).view(B, tree.num_nodes, H, D + Dv).permute(0, 2, 1, 3)
    node_k, node_v = nodes[..., :D].to(dtype), nodes[..., D:].to(dtype)
    q = torch.randn(B, H, M, D, generator=g, dtype=torch.float64).to(dtype)
    return tree, q, node_k, node_v


def op_args(tree, q, node_k, node_v, policy, scale=None, seed=3):
    uniforms = _draw_uniforms(q, tree, torch.Generator().manual_seed(seed)) if policy == "sample" else None
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return (q, node_k, node_v, tree.node_padding_mask, tree.branching, tree.height, tree.group_size, scale, uniforms)


def assert_matches_cpp(got, args, tol=1e-5):
    ref = torch.ops.attn_ext.tree_cross_attention_fwd(*args)
    assert torch.equal(got[2], ref[2]), "selected differs from the C++ op"
    for name, a, r in zip(("out", "lse", "selected", "log_prob", "entropy"), got, ref):
        assert a.dtype == r.dtype and a.shape == r.shape, f"{name}: {a.dtype} {tuple(a.shape)}"
        if name != "selected":
            torch.testing.assert_close(a, r, rtol=tol, atol=tol, msg=name)
    return ref


# ------------------------------------------------------------------------------------------- forward


@needs_cpp
@pytest.mark.parametrize("policy", ["greedy", "sample"])
@pytest.mark.parametrize("b,N", [(2, 37), (3, 80), (4, 150), (16, 300)])
@pytest.mark.parametrize("masked", [False, True])
def test_forward_matches_cpp_float32(policy, b, N, masked):
    tree, q, node_k, node_v = setup(N=N, b=b, masked=masked, seed=N + b, M=20 if b == 2 else 9)
    args = op_args(tree, q, node_k, node_v, policy)
    assert_matches_cpp(tree_cross_attention_fwd_triton(*args), args)


@pytest.mark.parametrize("policy", ["greedy", "sample"])
@pytest.mark.parametrize("b", [2, 3])
def test_forward_matches_reference(policy, b):
    tree, q, node_k, node_v = setup(N=60, b=b, seed=7 + b, D=7, Dv=5)
    out, lse, selected, log_prob, entropy = tree_cross_attention_fwd_triton(*op_args(tree, q, node_k, node_v, policy))
    ref = tree_cross_attention(q, node_k, node_v, tree, policy=policy, backend="reference",
                               generator=torch.Generator().manual_seed(3))
    assert torch.equal(selected, ref.selected)
    for name, a, r in (("out", out, ref.out), ("log_prob", log_prob, ref.log_prob), ("entropy", entropy, ref.entropy)):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5, msg=name)
    _, ref_lse = _attend(q, node_k, node_v, tree.node_padding_mask, selected, 1 / math.sqrt(7))
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


@needs_cpp
@pytest.mark.parametrize("N", [1, 2])
@pytest.mark.parametrize("policy", ["greedy", "sample"])
def test_forward_height_zero(N, policy):
    tree, q, node_k, node_v = setup(N=N, b=2, masked=False, seed=N)
    assert tree.height == 0 and tree.group_size == N
    args = op_args(tree, q, node_k, node_v, policy)
    got = tree_cross_attention_fwd_triton(*args)
    assert_matches_cpp(got, args)
    assert got[2].shape == (2, 13, N) and bool((got[3] == 0).all()) and bool((got[4] == 0).all())


@needs_cpp
@pytest.mark.parametrize("policy", ["greedy", "sample"])
def test_forward_large_group_is_chunked(policy):
    # b = 32, N = 30 gives one group of P = 30 leaves: two leaf chunks of the kernel.
    tree, q, node_k, node_v = setup(N=30, b=32, seed=2, M=5, D=3, Dv=2)
    assert tree.group_size == 30
    args = op_args(tree, q, node_k, node_v, policy)
    assert_matches_cpp(tree_cross_attention_fwd_triton(*args), args)
    # Height 1 with P = 40 per group (ids laid out by hand; the op only needs the layout's sizes).
    B, H, M, P = 2, 2, 6, 40
    num_nodes = 3 + 2 * P
    g = torch.Generator().manual_seed(4)
    mask = torch.rand(B, num_nodes, generator=g) < 0.3
    mask[:, :3] = False
    args = (torch.randn(B, H, M, 5, generator=g), torch.randn(B, H, num_nodes, 5, generator=g),
            torch.randn(B, H, num_nodes, 3, generator=g), mask, 2, 1, P, 0.5,
            torch.rand(B, M, 1, generator=g) if policy == "sample" else None)
    assert_matches_cpp(tree_cross_attention_fwd_triton(*args), args)


@needs_cpp
def test_forward_non_contiguous_inputs():
    tree, q, node_k, node_v = setup(N=50, b=3, seed=11, D=6, Dv=9)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)  # heads not outermost, as after a projection
    k_s = torch.cat([node_k, node_k], dim=-1)[..., ::2]   # last-dim stride 2
    v_p = torch.nn.functional.pad(node_v, (0, 5))[..., :9]  # row stride > Dv
    assert not (q_t.is_contiguous() or k_s.is_contiguous() or v_p.is_contiguous())
    args = op_args(tree, q_t, k_s, v_p, "sample", scale=0.3)
    got = tree_cross_attention_fwd_triton(*args)
    contiguous = (q_t.contiguous(), k_s.contiguous(), v_p.contiguous(), *args[3:])
    assert_matches_cpp(got, contiguous)


@needs_cpp
@pytest.mark.parametrize("b", [2, 3])
def test_forward_greedy_ties_pick_the_first_child(b):
    tree, q, node_k, node_v = setup(N=40, b=b, masked=False, seed=5, D=4, Dv=3)
    node_k = torch.zeros_like(node_k)  # every child scores 0: π is uniform at every level
    args = op_args(tree, q, node_k, node_v, "greedy")
    out, lse, selected, log_prob, entropy = assert_matches_cpp(tree_cross_attention_fwd_triton(*args), args)
    # Always the first child: the path runs through the first id of every level, and the rejected
    # ids of level l are the other children of that node.
    expected = torch.tensor([tree.level_offset(lv) * b + 1 + c for lv in range(tree.height) for c in range(1, b)])
    assert torch.equal(selected[..., : tree.height * (b - 1)], expected.expand(2, 13, -1))
    torch.testing.assert_close(log_prob, torch.full_like(log_prob, -tree.height * math.log(b)))


@needs_cpp
@pytest.mark.parametrize("policy", ["greedy", "sample"])
def test_forward_row_without_valid_node(policy):
    tree, q, node_k, node_v = setup(N=20, b=2, seed=6, D=5, Dv=4)
    mask = tree.node_padding_mask.clone()
    mask[0] = True  # a malformed tree: batch entry 0 has no valid node at all
    node_k[0] = float("nan")  # and garbage in its padding nodes must not leak
    node_v[0] = float("inf")
    args = op_args(tree._replace(node_padding_mask=mask), q, node_k, node_v, policy)
    out, lse, selected, log_prob, entropy = got = tree_cross_attention_fwd_triton(*args)
    assert bool((out[0] == 0).all()) and bool((lse[0] == -math.inf).all())
    assert not bool(torch.isnan(out).any()) and not bool(torch.isnan(lse).any())
    assert bool((log_prob[0] == -math.inf).all()) and bool((entropy[0] == 0).all())
    ref = torch.ops.attn_ext.tree_cross_attention_fwd(*args)
    assert torch.equal(selected, ref[2])
    torch.testing.assert_close(got[0][1], ref[0][1], rtol=1e-5, atol=1e-5)


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("policy", ["greedy", "sample"])
def test_forward_half_precision_flash_rule(dtype, policy):
    tree, q, node_k, node_v = setup(N=70, b=3, seed=9, dtype=dtype, M=11)
    args = op_args(tree, q, node_k, node_v, policy)
    out, lse, selected, log_prob, entropy = tree_cross_attention_fwd_triton(*args)
    assert out.dtype == dtype and lse.dtype == log_prob.dtype == entropy.dtype == torch.float32
    ref = torch.ops.attn_ext.tree_cross_attention_fwd(*args)  # also fp32 math on the same rounded inputs
    assert torch.equal(selected, ref[2])
    torch.testing.assert_close(log_prob, ref[3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref[4], rtol=1e-5, atol=1e-5)
    # Ground truth on the same selected set in fp64, and PyTorch's own computation in the input dtype.
    B, M, S = selected.shape
    sel_pad = tree.node_padding_mask.gather(1, selected.reshape(B, M * S)).view(B, 1, M, S)
    scale = args[7]

    def attend(dt):
        keys, values = _gather_nodes(node_k.to(dt), selected), _gather_nodes(node_v.to(dt), selected)
        return _attend_gathered(q.to(dt), keys, values, sel_pad, scale)

    (out64, lse64), (out_pt, lse_pt) = attend(torch.float64), attend(dtype)
    assert_within_flash_rule(out, out64, out_pt, name=f"{dtype} out")
    assert_within_flash_rule(lse, lse64, lse_pt.float(), name=f"{dtype} lse")


def test_forward_argument_errors():
    tree, q, node_k, node_v = setup(N=20, b=2, seed=1, D=4, Dv=3, M=3)
    args = list(op_args(tree, q, node_k, node_v, "sample"))
    with pytest.raises(ValueError, match="node_k must be"):
        tree_cross_attention_fwd_triton(q, node_k[:, :, :-1], *args[2:])
    with pytest.raises(ValueError, match="4-D"):
        tree_cross_attention_fwd_triton(q[0], *args[1:])
    with pytest.raises(TypeError, match="float64"):
        tree_cross_attention_fwd_triton(q.double(), node_k.double(), node_v.double(), *args[3:])
    with pytest.raises(TypeError, match="share a dtype"):
        tree_cross_attention_fwd_triton(q.half(), *args[1:])
    with pytest.raises(TypeError, match="bool"):
        tree_cross_attention_fwd_triton(*args[:3], tree.node_padding_mask.int(), *args[4:])
    with pytest.raises(ValueError, match="uniforms must be"):
        tree_cross_attention_fwd_triton(*args[:8], args[8][..., :-1])
    with pytest.raises(ValueError, match="branching"):
        tree_cross_attention_fwd_triton(*args[:4], 1, *args[5:])
    with pytest.raises(ValueError, match="scale"):
        tree_cross_attention_fwd_triton(*args[:7], math.nan, args[8])


# ------------------------------------------------------------------------------------------ backward


def _reference_grads(tree, q, node_k, node_v, selected, scale, grads):
    """Autograd in fp64 through path_forward (height 0: through the plain attention over S, since
    path_forward has no policy term there)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, node_k, node_v)]
    grad_out, grad_lse, grad_lp, grad_ent = (g.double() for g in grads)
    if tree.height == 0:
        outs = _attend(*leaves, tree.node_padding_mask, selected, scale)
        upstream = (grad_out, grad_lse)
    else:
        outs = path_forward(*leaves, tree.node_padding_mask, selected, tree.branching, tree.height,
                            tree.group_size, scale)
        upstream = (grad_out, grad_lse, grad_lp, grad_ent)
    got = torch.autograd.grad(outs, leaves, upstream, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(got, leaves)]


@pytest.mark.parametrize("policy", ["greedy", "sample"])
@pytest.mark.parametrize("b,N,masked", [(2, 37, True), (3, 50, False), (4, 90, True), (16, 200, True), (2, 1, False),
                                        (3, 3, False)])
def test_backward_matches_autograd_float32(policy, b, N, masked):
    tree, q, node_k, node_v = setup(N=N, b=b, masked=masked, seed=N * 3 + b, M=17 if b == 2 else 8)
    args = op_args(tree, q, node_k, node_v, policy)
    out, lse, selected, log_prob, entropy = tree_cross_attention_fwd_triton(*args)
    g = torch.Generator().manual_seed(b + N)
    grads = (torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g),
             torch.randn(log_prob.shape, generator=g), torch.randn(entropy.shape, generator=g))
    got = tree_cross_attention_bwd_triton(*grads, q, node_k, node_v, tree.node_padding_mask, selected, lse,
                                          b, tree.height, tree.group_size, args[7])
    ref = _reference_grads(tree, q, node_k, node_v, selected, args[7], grads)
    for name, a, r, leaf in zip(("dq", "dk", "dv"), got, ref, (q, node_k, node_v)):
        assert a.dtype == leaf.dtype and a.shape == leaf.shape, name
        torch.testing.assert_close(a.double(), r, rtol=1e-5, atol=2e-5, msg=name)
    padding = tree.node_padding_mask[:, None, :, None].expand_as(got[1][..., :1])
    assert bool((got[1].masked_select(padding) == 0).all()) and bool((got[2].masked_select(padding) == 0).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_backward_half_precision(dtype):
    tree, q, node_k, node_v = setup(N=40, b=2, seed=12, dtype=dtype, M=9, D=8, Dv=6)
    args = op_args(tree, q, node_k, node_v, "greedy")
    out, lse, selected, log_prob, entropy = tree_cross_attention_fwd_triton(*args)
    g = torch.Generator().manual_seed(1)
    grads = (torch.randn(out.shape, generator=g).to(dtype), torch.randn(lse.shape, generator=g),
             torch.randn(log_prob.shape, generator=g), torch.randn(entropy.shape, generator=g))
    got = tree_cross_attention_bwd_triton(*grads, q, node_k, node_v, tree.node_padding_mask, selected, lse,
                                          2, tree.height, tree.group_size, args[7])
    ref = _reference_grads(tree, q, node_k, node_v, selected, args[7], grads)
    for name, a, r in zip(("dq", "dk", "dv"), got, ref):
        assert a.dtype == dtype and not bool(torch.isnan(a).any()), name
        # fp32 math on rounded inputs: the only error beyond fp64 is the final rounding to dtype.
        torch.testing.assert_close(a.double(), r, rtol=2 * torch.finfo(dtype).eps, atol=2 * torch.finfo(dtype).eps
                                   * max(1.0, float(r.abs().max())), msg=name)


def test_backward_row_without_valid_node():
    tree, q, node_k, node_v = setup(N=20, b=2, seed=6, D=5, Dv=4, M=4)
    mask = tree.node_padding_mask.clone()
    mask[0] = True
    args = op_args(tree._replace(node_padding_mask=mask), q, node_k, node_v, "greedy")
    out, lse, selected, log_prob, entropy = tree_cross_attention_fwd_triton(*args)
    ones = (torch.ones_like(out), torch.ones_like(lse), torch.zeros_like(log_prob), torch.ones_like(entropy))
    dq, dk, dv = tree_cross_attention_bwd_triton(*ones, q, node_k, node_v, mask, selected, lse, 2, tree.height,
                                                 tree.group_size, args[7])
    assert bool((dq[0] == 0).all()) and bool((dk[0] == 0).all()) and bool((dv[0] == 0).all())
    assert not any(bool(torch.isnan(t).any()) for t in (dq, dk, dv))


# ------------------------------------------------------------------------ custom ops and public API

OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("policy", ["greedy", "sample"])
def test_opcheck_triton_ops(policy):
    tree, q, node_k, node_v = setup(B=1, H=2, M=4, N=13, D=8, Dv=5, seed=17)
    args = op_args(tree, q.requires_grad_(), node_k.requires_grad_(), node_v.requires_grad_(), policy)
    torch.library.opcheck(torch.ops.attn_ext.tree_cross_attention_fwd_triton, args, test_utils=OPCHECK_TESTS)
    out, lse, selected, log_prob, entropy = torch.ops.attn_ext.tree_cross_attention_fwd_triton(*args)
    grads = tuple(torch.randn_like(t) for t in (out, lse, log_prob, entropy))
    bwd_args = (*grads, *(t.detach() for t in args[:3]), args[3], selected, lse.detach(), *args[4:8])
    torch.library.opcheck(torch.ops.attn_ext.tree_cross_attention_bwd_triton, bwd_args, test_utils=OPCHECK_TESTS)


@needs_cpp
@pytest.mark.parametrize("policy", ["greedy", "sample", "full"])
def test_public_api_triton_equals_cpp_with_gradients(policy):
    tree, q, node_k, node_v = setup(B=2, H=2, M=6, N=50, b=3, D=8, Dv=6, seed=23)
    results = {}
    for backend in ("triton", "cpp"):
        inputs = tuple(t.detach().clone().requires_grad_() for t in (q, node_k, node_v))
        res = tree_cross_attention(*inputs, tree, policy=policy, backend=backend,
                                   generator=torch.Generator().manual_seed(5))
        loss = res.out.square().sum() + 0.5 * res.log_prob.sum() - 0.2 * res.entropy.sum()
        results[backend] = (res, torch.autograd.grad(loss, inputs))
    (tri, tri_grads), (cpp, cpp_grads) = results["triton"], results["cpp"]
    assert torch.equal(tri.selected, cpp.selected)
    torch.testing.assert_close(tri.out, cpp.out, rtol=1e-5, atol=1e-5)
    for g_tri, g_cpp in zip(tri_grads, cpp_grads):
        torch.testing.assert_close(g_tri, g_cpp, rtol=1e-4, atol=1e-5)
