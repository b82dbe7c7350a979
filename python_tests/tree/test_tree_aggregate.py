"""The fused C++ masked-mean aggregation (attn_ext::tree_aggregate_{fwd,bwd}) against the reference."""
import pytest
import torch

import attn_ext as ae
from attn_ext.ops.tree import build_tree, tree_aggregate
from attn_ext.ops.tree.build import token_leaf_of

from _helpers import assert_within_flash_rule

pytestmark = pytest.mark.skipif(
    ae.available_backends(torch.zeros(1))["cpp"] is not None, reason="attn_ext._C is not built"
)

OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def make_mask(kind, B, N, g):
    """Token padding (True = padding): none, random (~40 %), or a valid prefix per entry (whole subtrees padded)."""
    if kind == "none" or N == 1:
        return None
    if kind == "random":
        mask = torch.rand(B, N, generator=g) < 0.4
        mask[:, 0] = False
        return mask
    lengths = torch.randint(1, N + 1, (B,), generator=g)
    return torch.arange(N)[None, :] >= lengths[:, None]


def setup(B=2, N=20, b=2, E=59, mask="random", seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    tree = build_tree(torch.rand(B, N, 1, generator=g, dtype=torch.float64), branching=b,
                      key_padding_mask=make_mask(mask, B, N, g))
    values = torch.randn(B, N, E, generator=g, dtype=torch.float64).to(dtype)
    grad = torch.randn(B, tree.num_nodes, E, generator=g, dtype=torch.float64).to(dtype)
    return tree, values, grad


def forward_and_grad(tree, values, grad, backend):
    x = values.detach().requires_grad_()  # detach, not clone: keeps the layout under test
    nodes = tree_aggregate(tree, x, backend=backend)
    (g,) = torch.autograd.grad(nodes, x, grad)
    return nodes.detach(), g


def op_args(tree, values):
    return (values, tree.leaf_token, tree.node_padding_mask, tree.branching, tree.height, tree.group_size)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mask", ["none", "random", "lengths"])
@pytest.mark.parametrize("N", [1, 2, 5, 128, 1000])
@pytest.mark.parametrize("b", [2, 3, 4, 16])
def test_cpp_equals_reference(b, N, mask, dtype):
    tree, values, grad = setup(N=N, b=b, mask=mask, seed=N * 7 + b, dtype=dtype)
    nodes, dx = forward_and_grad(tree, values, grad, "cpp")
    ref_nodes, ref_dx = forward_and_grad(tree, values, grad, "reference")
    assert nodes.dtype == dtype and nodes.shape == (2, tree.num_nodes, 59) and nodes.is_contiguous()
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(nodes, ref_nodes, rtol=tol, atol=tol)
    torch.testing.assert_close(dx, ref_dx, rtol=tol, atol=tol)
    assert bool((nodes[tree.node_padding_mask] == 0).all())
    if mask != "none" and N > 1:
        masked_tokens = tree.node_padding_mask.gather(1, tree.leaf_offset + tree.token_leaf)
        assert bool((dx[masked_tokens] == 0).all())


def _layouts(values):
    B, N, E = values.shape
    return {
        "transposed": values.transpose(1, 2).contiguous().transpose(1, 2),  # E-stride N: copied by the kernel
        "padded_rows": torch.cat([values, values[..., :5]], dim=-1)[..., :E],  # unit stride, row stride E + 5
        "strided_last": torch.stack([values, -values], dim=-1).flatten(-2)[..., ::2],
        "broadcast_batch": values[:1].expand(B, N, E),
    }


@pytest.mark.parametrize("layout", ["transposed", "padded_rows", "strided_last", "broadcast_batch"])
def test_non_contiguous_leaf_values(layout):
    tree, values, grad = setup(B=3, N=77, b=3, E=9, seed=4)
    strided = _layouts(values)[layout]
    assert not strided.is_contiguous()
    nodes, dx = forward_and_grad(tree, strided, grad, "cpp")
    ref_nodes, ref_dx = forward_and_grad(tree, strided.contiguous(), grad, "reference")
    torch.testing.assert_close(nodes, ref_nodes, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-12, atol=1e-12)


def test_non_contiguous_grad_nodes():
    tree, values, grad = setup(N=40, b=2, E=6, seed=5)
    op = torch.ops.attn_ext.tree_aggregate_bwd
    args = (tree.leaf_token, tree.token_leaf, tree.node_padding_mask, 2, tree.height, tree.group_size, 40)
    wide = torch.cat([grad, grad], dim=-1)
    for strided in (wide[..., 6:], wide[..., ::2], grad.transpose(0, 1).contiguous().transpose(0, 1)):
        torch.testing.assert_close(op(strided, *args), op(strided.contiguous(), *args), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b,N,mask", [(2, 1000, "random"), (4, 128, "lengths"), (16, 1000, "none"), (3, 5, "random")])
def test_half_precision_within_flash_rule(dtype, b, N, mask):
    tree, values64, grad64 = setup(N=N, b=b, E=33, mask=mask, seed=N + b)
    values, grad = values64.to(dtype), grad64.to(dtype)
    nodes, dx = forward_and_grad(tree, values, grad, "cpp")
    assert nodes.dtype == dtype and dx.dtype == dtype
    ref_nodes, ref_dx = forward_and_grad(tree, values.double(), grad.double(), "reference")
    pt_nodes, pt_dx = forward_and_grad(tree, values, grad, "reference")
    assert_within_flash_rule(nodes, ref_nodes, pt_nodes, name=f"{dtype} nodes")
    assert_within_flash_rule(dx, ref_dx, pt_dx, grad=True, name=f"{dtype} grad")


def test_results_do_not_depend_on_the_thread_count():
    # B = 1 puts the parallel cut below the root (more levels above it with more threads).
    tree, values, grad = setup(B=1, N=3000, b=2, E=8, seed=6, dtype=torch.float32)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3, 7):
            torch.set_num_threads(n)
            results.append(forward_and_grad(tree, values, grad, "cpp"))
    finally:
        torch.set_num_threads(threads)
    for nodes, dx in results[1:]:
        assert torch.equal(nodes, results[0][0]) and torch.equal(dx, results[0][1])


def test_gradcheck_and_gradgradcheck_of_the_op():
    tree, values, _ = setup(B=2, N=11, b=3, E=3, seed=7)
    x = values.detach().requires_grad_()
    fn = lambda v: torch.ops.attn_ext.tree_aggregate_fwd(*op_args(tree, v))  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))
    assert torch.autograd.gradcheck(lambda v: tree_aggregate(tree, v, backend="cpp"), (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mask", ["none", "random"])
def test_opcheck_forward_op(dtype, mask):
    tree, values, _ = setup(B=2, N=13, b=2, E=5, mask=mask, seed=8, dtype=dtype)
    torch.library.opcheck(torch.ops.attn_ext.tree_aggregate_fwd, op_args(tree, values.requires_grad_()),
                          test_utils=OPCHECK_TESTS)


def test_opcheck_backward_op():
    tree, _, grad = setup(B=2, N=13, b=3, E=4, seed=9)
    args = (grad.requires_grad_(), tree.leaf_token, tree.token_leaf, tree.node_padding_mask, tree.branching,
            tree.height, tree.group_size, 13)
    torch.library.opcheck(torch.ops.attn_ext.tree_aggregate_bwd, args, test_utils=OPCHECK_TESTS)


def test_token_leaf_of_inverts_leaf_token():
    tree, _, _ = setup(B=3, N=50, b=4, seed=10)
    assert torch.equal(token_leaf_of(tree.leaf_token, 50), tree.token_leaf)


def test_compile_through_tree_aggregate():
    tree, values, grad = setup(N=30, b=2, E=4, seed=11, dtype=torch.float32)
    fn = torch.compile(lambda v: tree_aggregate(tree, v), backend="aot_eager", fullgraph=True)
    x = values.clone().requires_grad_()
    (fn(x) * grad).sum().backward()
    nodes, dx = forward_and_grad(tree, values, grad, "cpp")
    torch.testing.assert_close(fn(values), nodes, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, dx, rtol=0, atol=0)


def test_empty_feature_dim_and_single_token():
    tree, values, grad = setup(B=2, N=1, b=2, E=0)
    nodes, dx = forward_and_grad(tree, values, grad, "cpp")
    assert nodes.shape == (2, tree.num_nodes, 0) and dx.shape == (2, 1, 0)
    tree, values, _ = setup(B=1, N=1, b=2, E=3)
    torch.testing.assert_close(tree_aggregate(tree, values, backend="cpp"), values.expand(1, 2, 3), rtol=0, atol=0)


def uses_cpp(nodes):
    return "tree_aggregate_fwd" in type(nodes.grad_fn).__name__


def test_backend_selection(monkeypatch):
    tree, values, _ = setup(N=10, b=2, E=3)
    x = values.requires_grad_()
    assert uses_cpp(tree_aggregate(tree, x)) and uses_cpp(tree_aggregate(tree, x, backend="auto"))
    assert not uses_cpp(tree_aggregate(tree, x, backend="reference"))
    monkeypatch.setenv("ATTN_EXT_BACKEND", "reference")
    assert not uses_cpp(tree_aggregate(tree, x)) and uses_cpp(tree_aggregate(tree, x, backend="cpp"))
    monkeypatch.setenv("ATTN_EXT_BACKEND", "triton")  # not a tree_aggregate backend: automatic choice
    assert uses_cpp(tree_aggregate(tree, x))
    monkeypatch.delenv("ATTN_EXT_BACKEND")
    masked_sum = lambda c, m: c.masked_fill(m[..., None], 0).sum(-2)  # noqa: E731
    assert not uses_cpp(tree_aggregate(tree, x, reduce=masked_sum))
    with pytest.raises(RuntimeError, match="runs reduce='mean' only"):
        tree_aggregate(tree, x, reduce=masked_sum, backend="cpp")
    with pytest.raises(RuntimeError, match="triton: attn_ext has no triton implementation of tree_aggregate"):
        tree_aggregate(tree, x, backend="triton")
    ints = torch.arange(30).view(1, 10, 3).expand(2, 10, 3)
    torch.testing.assert_close(tree_aggregate(tree, ints), tree_aggregate(tree, ints, backend="reference"))
    with pytest.raises(RuntimeError, match="tree_aggregate: backend 'cpp' cannot run on cpu torch.int64"):
        tree_aggregate(tree, ints, backend="cpp")
    meta_tree = build_tree(torch.randn(2, 10, 1, device="meta"))
    meta_values = torch.randn(2, 10, 3, device="meta")
    assert tree_aggregate(meta_tree, meta_values).shape == (2, meta_tree.num_nodes, 3)
    with pytest.raises(RuntimeError, match="tree_aggregate: backend 'cpp' cannot run on meta"):
        tree_aggregate(meta_tree, meta_values, backend="cpp")


def test_reference_errors_are_unchanged_on_every_backend():
    tree, values, _ = setup(N=10, b=2, E=3)
    for backend in ("cpp", "reference", None):
        with pytest.raises(ValueError, match=r"leaf_values must be \[B, N, E\] with \[B, N\] = \[2, 10\]"):
            tree_aggregate(tree, values[:, 1:], backend=backend)
        with pytest.raises(ValueError, match="unknown reduce 'max'"):
            tree_aggregate(tree, values, reduce="max", backend=backend)


def test_bad_inputs_of_the_ops_raise_clear_errors():
    tree, values, grad = setup(N=10, b=2, E=3)
    fwd, bwd = torch.ops.attn_ext.tree_aggregate_fwd, torch.ops.attn_ext.tree_aggregate_bwd
    lt, pad, k, P = tree.leaf_token, tree.node_padding_mask, tree.height, tree.group_size
    bad_token = lt.clone()
    bad_token[0, 0] = 10
    cases = [
        ((values[0], lt, pad, 2, k, P), ValueError, "leaf_values .* must be 3-D"),
        ((values.long(), lt, pad, 2, k, P), TypeError, "dtype Long is not supported"),
        ((values, lt, pad, 1, k, P), ValueError, "branching must be >= 2"),
        ((values, lt, pad, 2, k, 0), ValueError, "group_size must be >= 1"),
        ((values, lt, pad, 2, k, 1000), ValueError, r"leaf_token must be \[B, group_size"),
        ((values, lt.int(), pad, 2, k, P), TypeError, "leaf_token must be int64"),
        ((values, lt, pad.long(), 2, k, P), TypeError, "node_padding_mask must be bool"),
        ((values, lt, pad[:, 1:], 2, k, P), ValueError, r"node_padding_mask must be \[B, num_nodes\]"),
        ((values, bad_token, pad, 2, k, P), ValueError, r"leaf_token names a token outside \[0, N = 10\)"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            fwd(*args)
    swapped = tree.token_leaf.flip(1)
    duplicated = lt.clone()
    duplicated[0, 1] = duplicated[0, 0]
    cases = [
        ((grad[:, 1:], lt, tree.token_leaf, pad, 2, k, P, 10), ValueError, r"grad_nodes must be \[B, num_nodes, E\]"),
        ((grad, lt, tree.token_leaf[:, 1:], pad, 2, k, P, 10), ValueError, r"token_leaf must be \[B, num_tokens\]"),
        ((grad, lt, tree.token_leaf, pad, 2, k, P, -1), ValueError, "num_tokens must be >= 0"),
        ((grad, lt, swapped, pad, 2, k, P, 10), ValueError, "must be inverse maps"),
        ((grad, duplicated, tree.token_leaf, pad, 2, k, P, 10), ValueError, "must be inverse maps"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            bwd(*args)
