"""``torch.func`` over the public ops: ``grad``, ``jvp``, ``vmap`` and their compositions against plain
autograd, finite differences and loops; a gradient penalty through the drop-in module against
``torch.nn.MultiheadAttention``; and the errors that name the op where a raw op cannot be transformed.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.attention
from torch.func import grad, jacfwd, jacrev, jvp, vmap

import attn_ext as ae
from attn_ext.ops.tree import build_tree, tree_cross_attention
from _helpers import require_backend

F64 = torch.float64


def _qkv(seed, B=2, H=2, M=3, N=6, D=4, Dv=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, E, generator=g, dtype=F64) for L, E in ((M, D), (N, D), (N, Dv))]


def _ops(backend):
    """(name, f(q, k, v) -> Tensor) for each public op that takes queries, keys and values."""
    mask = torch.tensor([[False, True, False, False, False, False], [False] * 5 + [True]])
    return [
        ("cross_attention", lambda q, k, v: ae.cross_attention(q, k, v, key_padding_mask=mask, backend=backend)),
        ("cross_attention_lse", lambda q, k, v: ae.cross_attention(q, k, v, return_lse=True, backend=backend)[1]),
        ("intention", lambda q, k, v: ae.intention(q, k, v, alpha=0.7, key_padding_mask=mask, backend=backend)),
        ("sigma_intention", lambda q, k, v: ae.sigma_intention(q, k, v, alpha=0.7, backend=backend)),
    ]


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_grad_jvp_and_hessian_agree_with_autograd_and_finite_differences(backend):
    q, k, v = _qkv(0)
    require_backend(backend, q)
    for name, f in _ops(backend):
        loss = lambda q: f(q, k, v).pow(2).sum()
        leaf = q.clone().requires_grad_()
        expected, = torch.autograd.grad(loss(leaf), leaf)
        torch.testing.assert_close(grad(loss)(q), expected, msg=name)
        tangent = torch.randn_like(q)
        _, got = jvp(lambda q: f(q, k, v), (q,), (tangent,))
        eps = 1e-6
        finite = (f(q + eps * tangent, k, v) - f(q - eps * tangent, k, v)) / (2 * eps)
        assert got.abs().max() > 1e-3, name  # the old defect: a zero tangent
        torch.testing.assert_close(got, finite, atol=1e-6, rtol=1e-5, msg=name)
        # Hessian-vector products two ways: forward over reverse and reverse over reverse
        hvp_fwd = jvp(grad(loss), (q,), (tangent,))[1]
        hvp_rev = grad(lambda q: (grad(loss)(q) * tangent).sum())(q)
        torch.testing.assert_close(hvp_fwd, hvp_rev, msg=name)


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_vmap_over_a_batch_of_problems_equals_a_loop(backend):
    problems = [_qkv(seed) for seed in range(3)]
    q, k, v = (torch.stack(t) for t in zip(*problems))
    require_backend(backend, q)
    for name, f in _ops(backend):
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no per-element fall-back of the op
            got = vmap(f)(q, k, v)
            grads = vmap(grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2)))(q, k, v)
        for i, (qi, ki, vi) in enumerate(problems):
            torch.testing.assert_close(got[i], f(qi, ki, vi), msg=name)
            leaves = [t.clone().requires_grad_() for t in (qi, ki, vi)]
            expected = torch.autograd.grad(f(*leaves).sum(), leaves)
            for a, b in zip(grads, expected):
                torch.testing.assert_close(a[i], b, msg=name)
    # unbatched keys and values: in_dims=None broadcasts them
    f = _ops(backend)[0][1]
    got = vmap(f, in_dims=(0, None, None))(q, problems[0][1], problems[0][2])
    torch.testing.assert_close(got[2], f(problems[2][0], problems[0][1], problems[0][2]))


def test_jacobians_of_merge_states_and_tree_cross_attention():
    g = torch.Generator().manual_seed(1)
    out_a, out_b = torch.randn(2, 1, 2, 3, 3, generator=g, dtype=F64).unbind(0)
    lse_a, lse_b = torch.randn(2, 1, 2, 3, generator=g, dtype=F64).unbind(0)
    merged = lambda oa: ae.merge_states(ae.AttentionState(oa, lse_a), ae.AttentionState(out_b, lse_b)).out
    torch.testing.assert_close(jacfwd(merged)(out_a), jacrev(merged)(out_a))

    tree = build_tree(torch.rand(1, 7, 1, generator=g, dtype=F64), branching=2)
    q = torch.randn(1, 2, 2, 3, generator=g, dtype=F64)
    node_k = torch.randn(1, 2, tree.num_nodes, 3, generator=g, dtype=F64)
    node_v = torch.randn(1, 2, tree.num_nodes, 2, generator=g, dtype=F64)
    for backend in ("cpp", "reference"):
        f = lambda node_k: tree_cross_attention(q, node_k, node_v, tree, backend=backend).out
        torch.testing.assert_close(jacfwd(f)(node_k), jacrev(f)(node_k))


def test_gradient_penalty_through_the_drop_in_module_matches_torch():
    torch.manual_seed(2)
    ours = ae.nn.MultiheadCrossAttention(8, 2, batch_first=True, dtype=F64)
    theirs = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=F64)
    theirs.load_state_dict(ours.state_dict())
    query = torch.randn(3, 4, 8, dtype=F64, requires_grad=True)
    context = torch.randn(3, 6, 8, dtype=F64)

    def penalty(module):
        out, _ = module(query, context, context, need_weights=False)
        g, = torch.autograd.grad(out.pow(2).sum(), query, create_graph=True)
        return torch.autograd.grad(g.pow(2).sum(), module.in_proj_weight)[0]

    # PyTorch's fused CPU kernel has no double backward itself: its math path is the reference.
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        expected = penalty(theirs)
    assert expected.abs().max() > 1e-3
    torch.testing.assert_close(penalty(ours), expected)


def test_raw_ops_under_torch_func_raise_errors_naming_the_op_and_the_public_function():
    q, k, v = _qkv(3)
    raw = lambda q: torch.ops.attn_ext.cross_attention_fwd(q, k, v, None, 0.5, 4)[0].sum()
    with pytest.raises(RuntimeError, match=r"torch\.ops\.attn_ext\.cross_attention_fwd.*attn_ext\.cross_attention"):
        grad(raw)(q)
    with pytest.raises(RuntimeError, match=r"torch\.func\.jvp.*cross_attention_fwd"):
        jvp(lambda q: torch.ops.attn_ext.cross_attention_fwd(q, k, v, None, 0.5, 4)[0], (q,), (q,))
    # vmap alone needs no derivative: the raw op runs, folded into its batch dimension
    got = vmap(lambda q: torch.ops.attn_ext.cross_attention_fwd(q, k, v, None, 0.5, 4)[0])(q[None].expand(2, -1, -1, -1, -1))
    torch.testing.assert_close(got[1], torch.ops.attn_ext.cross_attention_fwd(q, k, v, None, 0.5, 4)[0])


def test_backward_kernels_refuse_to_be_differentiated():
    q, k, v = (t.requires_grad_() for t in _qkv(4))
    out, lse = torch.ops.attn_ext.cross_attention_fwd(q, k, v, None, 0.5, 4)
    with pytest.raises(RuntimeError, match="cross_attention_bwd is not differentiable.*attn_ext.cross_attention"):
        torch.ops.attn_ext.cross_attention_bwd(torch.ones_like(out), torch.zeros_like(lse), q, k, v, None, out, lse,
                                               0.5, 4)


def test_raw_op_forward_mode_and_double_backward_work_without_torch_func():
    q, k, v = _qkv(5)
    tangent = torch.randn_like(q)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(q, tangent)
        out = torch.ops.attn_ext.cross_attention_fwd(dual, k, v, None, 0.5, 4)[0]
        got = torch.autograd.forward_ad.unpack_dual(out).tangent
    expected = jvp(lambda q: ae.cross_attention(q, k, v, scale=0.5), (q,), (tangent,))[1]
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_data_dependent_errors_still_raise_under_vmap(backend):
    q, k, v = _qkv(6, N=2)  # two keys for D = 4: with alpha = 0 the system is singular
    require_backend(backend, q)
    with pytest.raises(RuntimeError, match="singular"):
        vmap(lambda q, k, v: ae.intention(q, k, v, alpha=0.0, backend=backend))(q[None], k[None], v[None])
    with pytest.raises(ValueError, match="alpha must be finite and >= 0"):
        vmap(lambda a: ae.intention(q, k, v, alpha=a, backend=backend))(torch.tensor([[[1.0], [-1.0]]] * 2).to(F64))


def test_tree_aggregate_and_spd_solve_under_torch_func():
    g = torch.Generator().manual_seed(7)
    tree = build_tree(torch.rand(2, 11, 1, generator=g, dtype=F64), branching=3)
    values = torch.randn(2, 11, 3, generator=g, dtype=F64)
    aggregate = lambda x: ae.tree_aggregate(tree, x, backend="cpp")
    torch.testing.assert_close(jacfwd(aggregate)(values), jacrev(aggregate)(values))
    torch.testing.assert_close(vmap(aggregate)(values[None])[0], aggregate(values))
    x = torch.randn(3, 4, 4, generator=g, dtype=F64)
    A, B = x @ x.mT + 4 * torch.eye(4, dtype=F64), torch.randn(3, 4, 2, generator=g, dtype=F64)
    solve = lambda A: ae.batched_spd_solve(A, B)
    torch.testing.assert_close(jacfwd(solve)(A), jacrev(solve)(A))
    with pytest.raises(ValueError, match="not positive definite"):
        vmap(solve)(torch.stack([A, -A]))
