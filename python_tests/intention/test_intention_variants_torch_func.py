"""The Intention variants under torch.func (vmap, grad, jvp, hessian) and forward-mode AD.

Each variant is a composition of the fused Intention op and torch.linalg; these check that every
transform gives the answer plain autograd gives (or, for vmap, a loop over the batch), so a user's
meta-learning or second-order code cannot get a silently different value.
"""
import pytest
import torch
from torch.func import grad, hessian, jvp, vmap

import attn_ext as ae

from _intention_problems import F64, problem

VARIANTS = {
    "intention_map": lambda q, k, v: q @ ae.intention_map(k, v, alpha=0.3),
    "pinv_intention": lambda q, k, v: ae.pinv_intention(q, k, v, alpha=0.2),
    "convex_intention": lambda q, k, v: ae.convex_intention(q, k, v, theta=0.4),
    "kernelised_exact": lambda q, k, v: ae.kernelised_intention(q, k, v, alpha=0.3, lengthscale=1.3),
    "kernelised_nystrom": lambda q, k, v: ae.kernelised_intention(q, k, v, alpha=0.3, lengthscale=1.3,
                                                                  num_landmarks=5),
}


def inputs():
    q, k, v, _ = problem(B=3, H=2, M=4, N=9, D=3, Dv=2, seed=21)
    return q, k, v


@pytest.mark.parametrize("name", list(VARIANTS))
def test_vmap_over_the_batch_equals_a_loop(name):
    fn = VARIANTS[name]
    q, k, v = inputs()
    batched = vmap(lambda q, k, v: fn(q[None], k[None], v[None])[0])(q, k, v)
    looped = torch.cat([fn(q[i:i + 1], k[i:i + 1], v[i:i + 1]) for i in range(q.shape[0])])
    torch.testing.assert_close(batched, looped, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_grad_and_jvp_equal_autograd(name):
    fn = VARIANTS[name]
    q, k, v = inputs()
    weight = torch.randn(fn(q, k, v).shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    objective = lambda q, k, v: (fn(q, k, v) * weight).sum()
    got = grad(objective, argnums=(0, 1, 2))(q, k, v)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(objective(*leaves), leaves)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)
    # jvp: the directional derivative equals ⟨gradient, direction⟩ of the scalar objective.
    directions = tuple(torch.randn(t.shape, generator=torch.Generator().manual_seed(4 + i), dtype=F64)
                       for i, t in enumerate((q, k, v)))
    _, tangent = jvp(objective, (q, k, v), directions)
    torch.testing.assert_close(tangent, sum((w * d).sum() for w, d in zip(want, directions)), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("name", ["pinv_intention", "convex_intention", "kernelised_exact"])
def test_hessian_with_respect_to_the_queries_is_symmetric_and_matches_double_backward(name):
    fn = VARIANTS[name]
    q, k, v = problem(B=1, H=1, M=2, N=6, D=2, Dv=1, seed=22)[:3]
    objective = lambda q: torch.tanh(fn(q, k, v)).sum()
    h = hessian(objective)(q).reshape(q.numel(), q.numel())
    torch.testing.assert_close(h, h.T, rtol=1e-9, atol=1e-11)
    leaf = q.clone().requires_grad_()
    first = torch.autograd.grad(objective(leaf), leaf, create_graph=True)[0].flatten()
    rows = torch.stack([torch.autograd.grad(first[i], leaf, retain_graph=True)[0].flatten() for i in range(q.numel())])
    torch.testing.assert_close(h, rows, rtol=1e-9, atol=1e-11)
