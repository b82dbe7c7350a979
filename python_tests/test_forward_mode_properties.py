"""Forward mode of every differentiable public op and module, against reverse mode, on every backend here.

For each case of _forward_mode_cases.py (every differentiable input, float masks, ``alpha`` and
``theta`` included):

* the tangent of ``torch.func.jvp`` and of ``torch.autograd.forward_ad`` equals ``J t`` with ``J`` from
  ``torch.func.jacrev`` (a float mask once got a tangent of 0 here: a dual tensor does not report
  ``requires_grad``);
* forward over forward (a ``jvp`` of a ``jvp``; ``jacfwd(jacfwd)``) equals reverse over reverse
  (``jacrev(jacrev)``): through an ``autograd.Function``'s ``jvp`` rule PyTorch got these silently wrong.

Reverse mode is the yardstick because test_autograd_orders.py checks it against finite differences.
fp64 on cpp and reference; float32 on Triton (interpreter) for the ops it runs.
"""
from __future__ import annotations

import pytest
import torch
from torch.autograd import forward_ad
from torch.func import jacfwd, jacrev, jvp

from attn_ext.models import MODELS, build_model

from _forward_mode_cases import CASES, TRITON_CASES
from _helpers import require_backend

BACKEND_CASES = [(name, backend) for name in CASES for backend in ("cpp", "reference")] + \
    [(name, "triton") for name in TRITON_CASES]


@pytest.fixture
def on_backend(monkeypatch):
    def select(backend, dtype):
        require_backend(backend, torch.empty(1, dtype=dtype))
        monkeypatch.setenv("ATTN_EXT_BACKEND", backend)
    return select


def _dtype(backend):
    return torch.float32 if backend == "triton" else torch.float64


def _tolerances(dtype):
    return dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-3, atol=2e-4)


def _tangents(inputs, seed):
    g = torch.Generator().manual_seed(seed)
    tangents = []
    for x in inputs:
        t = torch.randn(x.shape, generator=g, dtype=x.dtype)
        tangents.append(torch.where(torch.isfinite(x), t, torch.zeros_like(t)))  # no tangent on a -inf mask entry
    return tuple(tangents)


def _jacobian_times(fn, inputs, tangents):
    """``Σ_i J_i t_i`` from reverse mode."""
    jacobians = jacrev(fn, argnums=tuple(range(len(inputs))))(*inputs)
    out = fn(*inputs)
    return sum((j.reshape(out.numel(), -1) @ t.reshape(-1)) for j, t in zip(jacobians, tangents)).reshape(out.shape)


@pytest.mark.parametrize("name, backend", BACKEND_CASES)
def test_first_order_tangent_of_every_input_equals_reverse_mode(name, backend, on_backend):
    dtype = _dtype(backend)
    on_backend(backend, dtype)
    fn, inputs = CASES[name](dtype)
    tangents = _tangents(inputs, 1)
    expected = _jacobian_times(fn, inputs, tangents)
    assert expected.abs().max() > 1e-3, "the case must have a nonzero derivative to be able to fail"

    _, functorch_tangent = jvp(fn, tuple(inputs), tangents)
    torch.testing.assert_close(functorch_tangent, expected, **_tolerances(dtype))

    with forward_ad.dual_level():
        dual_out = fn(*(forward_ad.make_dual(x, t) for x, t in zip(inputs, tangents)))
        dual_tangent = forward_ad.unpack_dual(dual_out).tangent
    assert dual_tangent is not None, f"{name}: forward_ad gave no tangent at all"
    torch.testing.assert_close(dual_tangent, expected, **_tolerances(dtype))

    for i in range(len(inputs)):  # each input alone: a tangent dropped for one input shows here
        alone = tuple(t if j == i else torch.zeros_like(t) for j, t in enumerate(tangents))
        torch.testing.assert_close(jvp(fn, tuple(inputs), alone)[1], _jacobian_times(fn, inputs, alone),
                                   **_tolerances(dtype))


@pytest.mark.parametrize("name, backend", BACKEND_CASES)
def test_forward_over_forward_equals_reverse_over_reverse(name, backend, on_backend):
    dtype = _dtype(backend)
    on_backend(backend, dtype)
    fn, inputs = CASES[name](dtype)
    weights = torch.randn(fn(*inputs).shape, generator=torch.Generator().manual_seed(2), dtype=dtype)

    def objective(*xs):
        return (torch.where(torch.isfinite(out := fn(*xs)), out, torch.zeros_like(out)) * weights).sum()

    t1, t2 = _tangents(inputs, 3), _tangents(inputs, 4)
    # t2ᵀ H t1 by forward over forward ...
    ours = jvp(lambda *xs: jvp(objective, xs, t1)[1], tuple(inputs), t2)[1]
    # ... and by reverse over reverse
    hessian = jacrev(jacrev(objective, argnums=tuple(range(len(inputs)))), argnums=tuple(range(len(inputs))))(*inputs)
    expected = sum((hessian[i][j] * t1[i].reshape(t1[i].shape + (1,) * t2[j].dim()) * t2[j]).sum()
                   for i in range(len(inputs)) for j in range(len(inputs)))
    assert expected.abs() > 1e-4, "the case must have a nonzero second derivative to be able to fail"
    torch.testing.assert_close(ours, expected, **_tolerances(dtype))

    # The full Hessian of the first input by jacfwd(jacfwd), as the issue reported it.
    first = lambda x: objective(x, *inputs[1:])  # noqa: E731
    torch.testing.assert_close(jacfwd(jacfwd(first))(inputs[0]), hessian[0][0], **_tolerances(dtype))


MODEL_SIZE = dict(d_model=8, num_layers=1, num_heads=2, ff_dim=8, emb_depth=2, num_latents=2)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_forward_mode_and_forward_over_forward(name):
    """The reference NPs as wholes: their LayerNorms (PyTorch's own is wrong under forward over forward,
    pytorch/pytorch#196700) and every attn_ext op inside, on the default backend."""
    torch.manual_seed(0)
    model = build_model(name, **MODEL_SIZE).double().eval()
    g = torch.Generator().manual_seed(1)
    xc, yc = (torch.rand(1, 4, 1, generator=g, dtype=torch.float64) for _ in range(2))
    xt = xc[:, :2] + 0.05  # targets among the context points: every model's prediction depends on them

    def prediction(xc, yc, xt):
        normal = model.marginals(xc, yc, xt)
        return torch.cat([normal.mean.reshape(-1), normal.stddev.reshape(-1)])

    inputs = (xc, yc, xt)
    tangents = _tangents(inputs, 5)
    expected = _jacobian_times(prediction, inputs, tangents)
    assert expected.abs().max() > 1e-4
    torch.testing.assert_close(jvp(prediction, inputs, tangents)[1], expected, **_tolerances(torch.float64))

    weights = torch.randn(expected.shape, generator=g, dtype=torch.float64)
    objective = lambda yc: (prediction(xc, yc, xt) * weights).sum()  # noqa: E731
    hessian = jacrev(jacrev(objective))(yc)
    assert hessian.abs().max() > 1e-5
    torch.testing.assert_close(jacfwd(jacfwd(objective))(yc), hessian, **_tolerances(torch.float64))
