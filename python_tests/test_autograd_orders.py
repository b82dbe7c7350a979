"""Every differentiable op, on every CPU-runnable backend, beyond first-order reverse mode: second
derivatives (gradgradcheck in fp64), forward mode (gradcheck's forward-AD check and ``torch.func.jvp``),
``torch.func.grad`` and ``vmap`` against a loop, and the clear errors where a path is refused.
"""
from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

import attn_ext as ae
from attn_ext.ops.tree import build_tree, tree_aggregate, tree_cross_attention
from _helpers import require_backend

F64 = torch.float64


def _inputs(seed, B=2, H=2, M=3, N=5, D=4, Dv=3, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, L, E, generator=g, dtype=F64) for L, E in ((M, D), (N, D), (N, Dv)))
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


MASK = torch.tensor([[False, True, False, False, True], [True, False, False, False, False]])


def _check_all_modes(fn, inputs, fast_mode=True):
    """Reverse (first and second order) and forward mode (also forward over reverse) against finite
    differences in fp64. ``fast_mode`` checks random projections of the Jacobians (as able to fail, far
    cheaper on the larger ops); vmap'ed gradients are checked in test_torch_func.py."""
    assert gradcheck(fn, inputs, check_forward_ad=True, fast_mode=fast_mode)
    assert gradgradcheck(fn, inputs, check_fwd_over_rev=True, fast_mode=fast_mode)


# --------------------------------------------------------------------------------- cross attention
@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_cross_attention_all_orders(backend):
    q, k, v = _inputs(0)
    require_backend(backend, q)
    _check_all_modes(lambda q, k, v: ae.cross_attention(q, k, v, key_padding_mask=MASK, chunk_size=2,
                                                         return_lse=True, backend=backend), (q, k, v), fast_mode=False)


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_second_derivatives_of_a_fully_padded_row_are_zero(backend):
    q, k, v = _inputs(1)
    mask = MASK.clone()
    mask[1] = True  # batch entry 1 has no key: out = 0, lse = -inf, every derivative 0
    out = ae.cross_attention(q, k, v, key_padding_mask=mask, backend=backend)
    g, = torch.autograd.grad(out.pow(2).sum() + out.sum(), q, create_graph=True)
    second = torch.autograd.grad(g.pow(2).sum() + g.sum(), (q, k, v), allow_unused=True)
    for t in second:
        assert torch.isfinite(t).all()
        assert t[1].abs().max() == 0
    assert second[0][0].abs().max() > 0


def test_double_backward_matches_plain_pytorch_values():
    """The defect this suite guards: the default backend once gave zeros (and a warning) here."""
    q, k, v = _inputs(2)
    out = ae.cross_attention(q, k, v)
    g, = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    ours = torch.autograd.grad(g.sum(), (q, k, v))
    expected_out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    g_ref, = torch.autograd.grad(expected_out.pow(2).sum(), q, create_graph=True)
    expected = torch.autograd.grad(g_ref.sum(), (q, k, v))
    for a, b in zip(ours, expected):
        assert b.abs().max() > 1e-3
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_merge_states_all_orders(backend):
    g = torch.Generator().manual_seed(3)
    out_a, out_b = (torch.randn(2, 2, 3, 4, generator=g, dtype=F64, requires_grad=True) for _ in range(2))
    lse_a, lse_b = (torch.randn(2, 2, 3, generator=g, dtype=F64, requires_grad=True) for _ in range(2))
    _check_all_modes(lambda oa, la, ob, lb: tuple(ae.merge_states(ae.AttentionState(oa, la), ae.AttentionState(ob, lb), backend=backend)),
                     (out_a, lse_a, out_b, lse_b))


# ------------------------------------------------------------------------------------------- tree
def _tree_inputs(seed=4):
    g = torch.Generator().manual_seed(seed)
    # Small on purpose: gradgradcheck perturbs every node entry and redoes a backward for each.
    tree = build_tree(torch.rand(2, 5, 1, generator=g, dtype=F64), branching=2)
    q = torch.randn(2, 1, 2, 3, generator=g, dtype=F64, requires_grad=True)
    node_k = torch.randn(2, 1, tree.num_nodes, 3, generator=g, dtype=F64, requires_grad=True)
    node_v = torch.randn(2, 1, tree.num_nodes, 2, generator=g, dtype=F64, requires_grad=True)
    return tree, q, node_k, node_v


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_tree_cross_attention_all_orders(backend):
    tree, q, node_k, node_v = _tree_inputs()
    require_backend(backend, q)

    def fn(q, node_k, node_v):
        r = tree_cross_attention(q, node_k, node_v, tree, backend=backend)
        return r.out, r.log_prob, r.entropy

    _check_all_modes(fn, (q, node_k, node_v))


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_tree_aggregate_all_orders(backend):
    g = torch.Generator().manual_seed(5)
    tree = build_tree(torch.rand(2, 11, 1, generator=g, dtype=F64), branching=3)
    values = torch.randn(2, 11, 3, generator=g, dtype=F64, requires_grad=True)
    _check_all_modes(lambda x: tree_aggregate(tree, x, backend=backend), (values,))


# -------------------------------------------------------------------------------------- intention
@pytest.mark.parametrize("backend", ["cpp", "reference"])
@pytest.mark.parametrize("op", ["intention", "sigma_intention"])
def test_intention_all_orders(backend, op):
    q, k, v = _inputs(6, B=2, H=1, M=2, N=7, D=3, Dv=2)
    require_backend(backend, q)
    alpha = torch.tensor([[0.5], [2.0]], dtype=F64, requires_grad=True)  # [B, H]
    fn = getattr(ae, op)
    _check_all_modes(lambda q, k, v, a: fn(q, k, v, alpha=a, key_padding_mask=MASK[:, [0, 1, 2, 3, 4, 0, 1]],
                                           backend=backend), (q, k, v, alpha))


def test_batched_spd_solve_all_orders():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 4, 4, generator=g, dtype=F64)
    A = (x @ x.mT + 4 * torch.eye(4, dtype=F64)).requires_grad_()
    B = torch.randn(3, 4, 2, generator=g, dtype=F64, requires_grad=True)
    _check_all_modes(lambda A, B: ae.batched_spd_solve(A.tril(), B), (A, B))


# ----------------------------------------------------------------------------------------- Triton
def test_triton_second_derivatives_match_the_fp64_composite():
    q, k, v = (t.detach().float().requires_grad_() for t in _inputs(8))
    require_backend("triton", q)

    def second(backend, q, k, v):
        out = ae.cross_attention(q, k, v, key_padding_mask=MASK, backend=backend)
        g, = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
        return torch.autograd.grad(g.sum(), (q, k, v))

    expected = second("reference", *(t.detach().double().requires_grad_() for t in (q, k, v)))
    for a, b in zip(second("triton", q, k, v), expected):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4)
