"""Every derivative path of ``ae.te_attention``: fp64 gradcheck and gradgradcheck of all nine tensors (first order
from the fused backward, second through the composite), forward mode, ``torch.func`` (grad, jvp, jacfwd over
jacrev, vmap with shared and with per-element weights), ``opcheck`` of the ops and ``torch.compile``."""
from __future__ import annotations

import pytest
import torch
from torch.autograd import forward_ad
from torch.library import opcheck

import attn_ext as ae
from python_tests._helpers import require_backend
from python_tests.te_attention._te_problems import dense, make_mask, make_problem

BACKENDS = ("cpp", "reference")


def _fn(backend, mask=None, activation="gelu"):
    def f(*tensors):
        return ae.te_attention(*tensors, key_padding_mask=mask, activation=activation, return_lse=True,
                               backend=backend)
    return f


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_gradcheck_and_gradgradcheck(backend, activation):
    problem = [t.requires_grad_() for t in make_problem(2, 2, 3, 6, 3, 2, 2, 5)]
    require_backend(backend, problem[0])
    mask = make_mask(2, 6, "padding")
    f = _fn(backend, mask, activation)
    assert torch.autograd.gradcheck(f, problem)
    assert torch.autograd.gradgradcheck(f, problem)


def _problem_on(backend):
    problem = make_problem(2, 2, 4, 7, 3, 2, 2, 5)
    require_backend(backend, problem[0])
    return problem


def _assert_all_close(ours, theirs):
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_mode_equals_the_dense_formulas(backend):
    problem = _problem_on(backend)
    g = torch.Generator().manual_seed(9)
    tangents = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in problem]
    with forward_ad.dual_level():
        out, lse = _fn(backend)(*[forward_ad.make_dual(t, d) for t, d in zip(problem, tangents)])
        ours = [forward_ad.unpack_dual(r).tangent for r in (out, lse)]
    _, theirs = torch.func.jvp(lambda *t: dense(t, activation="gelu"), tuple(problem), tuple(tangents))
    _assert_all_close(ours, theirs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_func_transforms(backend):
    problem = _problem_on(backend)
    f = _fn(backend)
    argnums = tuple(range(9))
    ours = torch.func.grad(lambda *t: f(*t)[0].square().sum(), argnums=argnums)(*problem)
    theirs = torch.func.grad(lambda *t: dense(t, activation="gelu")[0].square().sum(), argnums=argnums)(*problem)
    _assert_all_close(ours, theirs)
    # Second order by torch.func: the Hessian-vector structure of one weight.
    hessian = torch.func.jacfwd(torch.func.jacrev(lambda b2: f(*problem[:8], b2)[0].sum()))(problem[8])
    reference = torch.func.jacfwd(torch.func.jacrev(lambda b2: dense([*problem[:8], b2], activation="gelu")[0].sum()))(
        problem[8])
    torch.testing.assert_close(hessian, reference, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_with_shared_and_with_per_element_weights(backend):
    problem = _problem_on(backend)
    f = _fn(backend)
    stacked = [torch.stack([t, t.flip(0) if t.dim() > 2 else t * 0.5]) for t in problem[:5]]
    out, lse = torch.func.vmap(lambda *x: f(*x, *problem[5:]))(*stacked)
    for i in range(2):
        expected = f(*[s[i] for s in stacked], *problem[5:])
        torch.testing.assert_close(out[i], expected[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[i], expected[1], rtol=1e-12, atol=1e-12)
    weights = [torch.stack([w, 2 * w]) for w in problem[5:]]       # an ensemble of two MLPs
    out, _ = torch.func.vmap(lambda *w: f(*problem[:5], *w))(*weights)
    for i in range(2):
        torch.testing.assert_close(out[i], f(*problem[:5], *[w[i] for w in weights])[0], rtol=1e-12, atol=1e-12)
    # Per-sample gradients of the weights (the backward op returns weight gradients: its vmap runs per element).
    def loss(w1, *entry):
        return f(*[t[None] for t in entry], w1, *problem[6:])[0].sum()

    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0, 0, 0, 0))(problem[5], *problem[:5])
    loop = torch.stack([torch.func.grad(loss)(problem[5], *[t[i] for t in problem[:5]]) for i in range(2)])
    torch.testing.assert_close(grads, loop, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(loop[0], loop[1])


@pytest.mark.parametrize("op", ["te_attention_fwd", "te_attention_fwd_reference"])
def test_opcheck(op):
    problem = make_problem(2, 2, 3, 6, 3, 2, 2, 5)
    require_backend("cpp" if op == "te_attention_fwd" else "reference", problem[0])
    mask = make_mask(2, 6, "padding")
    for args in ((*problem, mask, 0.5, 0, 0), (*problem, None, 0.3, 3, 2)):
        opcheck(getattr(torch.ops.attn_ext, op).default, args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph(backend):
    problem = [t.requires_grad_() for t in make_problem(2, 2, 5, 9, 4, 3, 2, 6)]
    require_backend(backend, problem[0])
    mask = make_mask(2, 9, "padding")
    compiled = torch.compile(lambda *t: ae.te_attention(*t, key_padding_mask=mask, backend=backend), fullgraph=True)
    out = compiled(*problem)
    expected = ae.te_attention(*problem, key_padding_mask=mask, backend=backend)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    ours = torch.autograd.grad(out.sum(), problem)
    theirs = torch.autograd.grad(expected.sum(), problem)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
