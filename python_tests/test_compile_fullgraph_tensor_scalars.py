"""``torch.compile(fullgraph=True)`` over every public op and module that takes a scalar which can be a tensor.

Those are the Intention family's ``alpha``, ``theta`` and ``lengthscale`` (the other ops' scalars, such as
``scale``, are Python floats only: a tensor is refused) and the modules built on them, whose learned ridge
is such a tensor. For each, the compiled function (backend ``aot_eager``) must give the eager value and
gradients, on a batch whose heads take different forms (fewer valid keys than D in one batch entry, so
``form="auto"`` makes a per-head choice the graph cannot read on the host), and the data-dependent checks
must still raise when the compiled function runs (docs/intention.md, "torch.compile").
"""
from __future__ import annotations

import inspect
import math
import typing
from typing import Callable, Dict, List, Tuple

import pytest
import torch
from torch import Tensor

import attn_ext as ae
from attn_ext.models import IntentionNP
from _helpers import require_backend

F64 = torch.float64


def problem(dtype=F64):
    """``q [2, 2, 4, 6]``, ``k, v [2, 2, 8, 6 / 3]`` and a mask keeping 3 keys (< D) of entry 0, all 8 of entry 1."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, d, generator=g, dtype=F64).to(dtype) for n, d in ((4, 6), (8, 6), (8, 3)))
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, 3:] = True
    return q, k, v, mask


def per_head(value: float, dtype=F64) -> Tensor:
    return torch.full((2,), value, dtype=dtype)


#: name -> (function of (q, k, v, mask, scalars...), good scalars, [(bad scalars, error pattern)]).
#: The bad values are those an eager call refuses (a ValueError there, RuntimeError in the compiled graph).
SINGULAR = r"attn_ext\.\w+: .*singular"
OPS: Dict[str, Tuple[Callable, Tuple[float, ...], List[Tuple[Tuple[float, ...], str]]]] = {
    "intention": (lambda q, k, v, m, a: ae.intention(q, k, v, alpha=a, key_padding_mask=m), (1e-3,),
                  [((-1.0,), r"attn_ext\.intention: alpha must be finite and >= 0"), ((0.0,), SINGULAR)]),
    "intention(form='dual')": (lambda q, k, v, m, a: ae.intention(q, k, v, alpha=a, key_padding_mask=m, form="dual"),
                               (1e-3,), [((0.0,), SINGULAR)]),
    "sigma_intention": (lambda q, k, v, m, a: ae.sigma_intention(q, k, v, alpha=a, key_padding_mask=m), (1e-3,),
                        [((math.nan,), r"attn_ext\.sigma_intention: alpha must be finite"), ((0.0,), SINGULAR)]),
    "intention_map": (lambda q, k, v, m, a: ae.intention_map(k, v, alpha=a, key_padding_mask=m), (1e-3,),
                      [((0.0,), SINGULAR)]),
    "intention_map(pinv=True)": (lambda q, k, v, m, a: ae.intention_map(k, v, alpha=a, key_padding_mask=m, pinv=True),
                                 (1e-3,), [((-1.0,), r"attn_ext\.intention_map: alpha must be")]),
    "intention_from_state": (lambda q, k, v, m, a: ae.intention_from_state(
        q, ae.intention_state(k, v, key_padding_mask=m), alpha=a), (1e-3,), [((0.0,), SINGULAR)]),
    "intention_map_from_state": (lambda q, k, v, m, a: ae.intention_map_from_state(
        ae.intention_state(k, v, key_padding_mask=m), alpha=a), (1e-3,), [((0.0,), SINGULAR)]),
    "intention_map_from_state(pinv=True)": (lambda q, k, v, m, a: ae.intention_map_from_state(
        ae.intention_state(k, v, key_padding_mask=m), alpha=a, pinv=True), (0.5,),
        [((-1.0,), r"attn_ext\.intention_map_from_state: alpha must be")]),
    "pinv_intention": (lambda q, k, v, m, a: ae.pinv_intention(q, k, v, alpha=a, key_padding_mask=m), (1e-3,),
                       [((-1.0,), r"attn_ext\.pinv_intention: alpha must be")]),
    "pinv_intention_from_state": (lambda q, k, v, m, a: ae.pinv_intention_from_state(
        q, ae.intention_state(k, v, key_padding_mask=m), alpha=a), (0.5,),
        [((math.inf,), r"attn_ext\.pinv_intention_from_state: alpha must be")]),
    "convex_intention": (lambda q, k, v, m, t: ae.convex_intention(q, k, v, theta=t, key_padding_mask=m), (7.0,),
                         [((math.nan,), r"attn_ext\.convex_intention: theta must be real"), ((math.inf,), SINGULAR)]),
    "kernelised_intention": (lambda q, k, v, m, a, ell: ae.kernelised_intention(
        q, k, v, alpha=a, lengthscale=ell, key_padding_mask=m), (0.1, 1.5),
        [((-1.0, 1.5), r"attn_ext\.kernelised_intention: alpha must be"),
         ((0.1, 0.0), r"attn_ext\.kernelised_intention: lengthscale must be positive")]),
    "kernelised_intention(num_landmarks=3)": (lambda q, k, v, m, a, ell: ae.kernelised_intention(
        q, k, v, alpha=a, lengthscale=ell, key_padding_mask=m, num_landmarks=3), (0.1, 1.5),
        [((0.1, -2.0), r"attn_ext\.kernelised_intention: lengthscale must be positive")]),
}

#: What each public op's tensor scalars are called (checked against the signatures below).
COVERED = {"intention": {"alpha"}, "sigma_intention": {"alpha"}, "intention_map": {"alpha"},
           "intention_from_state": {"alpha"}, "intention_map_from_state": {"alpha"}, "pinv_intention": {"alpha"},
           "pinv_intention_from_state": {"alpha"}, "convex_intention": {"theta"},
           "kernelised_intention": {"alpha", "lengthscale"}}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test traces its own graphs (lambdas of one test share a code object across its parameters)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


def _values_and_gradients(fn: Callable, inputs: List[Tensor], mask: Tensor) -> List[Tensor]:
    out = fn(*inputs[:3], mask, *inputs[3:])
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    grads = torch.autograd.grad((out * weights).sum(), [x for x in inputs if x.requires_grad], allow_unused=True)
    return [out.detach(), *[g if g is not None else torch.zeros(()) for g in grads]]


def test_every_public_op_with_a_tensor_scalar_is_covered():
    found = {}
    for name in ae.__all__:
        fn = getattr(ae, name)
        if not inspect.isfunction(fn):
            continue
        hints = typing.get_type_hints(fn)
        for param in inspect.signature(fn).parameters.values():
            takes_tensor = Tensor in typing.get_args(hints.get(param.name)) if param.name in hints else False
            if takes_tensor and isinstance(param.default, (int, float)) and not isinstance(param.default, bool):
                found.setdefault(name, set()).add(param.name)
    assert found == COVERED
    assert {name.split("(")[0] for name in OPS} == set(COVERED)


@pytest.mark.parametrize("name", list(OPS))
def test_compiled_op_equals_eager_and_still_raises(name):
    fn, good, bad = OPS[name]
    q, k, v, mask = problem()
    scalars = [per_head(x).requires_grad_() for x in good]
    inputs = [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), *scalars]
    compiled = _compiled(fn)
    expected = _values_and_gradients(fn, inputs, mask)
    got = _values_and_gradients(compiled, inputs, mask)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)
    for values, pattern in bad:
        # requires_grad as above: the same compiled graph runs on the bad values (no retrace).
        scalars = [per_head(x).requires_grad_() for x in values]
        with pytest.raises(ValueError if "must be" in pattern else RuntimeError, match=pattern):
            fn(q, k, v, mask, *scalars)      # eager
        with pytest.raises(RuntimeError, match=pattern):
            compiled(q, k, v, mask, *scalars)


@pytest.mark.parametrize("backend", ["reference", "cpp", "triton"])
def test_compiled_intention_and_sigma_intention_on_every_backend(backend):
    q, k, v, mask = problem(torch.float32)
    require_backend(backend, q)
    alpha = per_head(1e-3, torch.float32).requires_grad_()
    for op in (ae.intention, ae.sigma_intention):
        fn = lambda q, k, v, m, a: op(q, k, v, alpha=a, key_padding_mask=m, backend=backend)  # noqa: E731
        expected = _values_and_gradients(fn, [q, k, v, alpha], mask)
        got = _values_and_gradients(_compiled(fn), [q, k, v, alpha], mask)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
        with pytest.raises(RuntimeError, match=SINGULAR):
            _compiled(fn)(q, k, v, mask, per_head(0.0, torch.float32).requires_grad_())


def _modules() -> Dict[str, Tuple[torch.nn.Module, Callable]]:
    torch.manual_seed(0)
    x, ctx = torch.randn(2, 5, 12, dtype=F64), torch.randn(2, 7, 12, dtype=F64)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0, 2:] = True                                  # 2 valid keys for head dim 6
    xc, yc, xt = torch.randn(2, 4, 1, dtype=F64), torch.randn(2, 4, 1, dtype=F64), torch.randn(2, 3, 1, dtype=F64)
    cases = {
        "nn.Intention": (ae.nn.Intention(12, 2, alpha_init=1e-3), lambda m: m(x, ctx, ctx, pad)),
        "nn.Intention(sigma=True)": (ae.nn.Intention(12, 2, alpha_init=1e-3, sigma=True),
                                     lambda m: m(x, ctx, ctx, pad)),
        "nn.Intention(form='paper', alpha_from_context=True)": (
            ae.nn.Intention(12, 2, alpha_init=1e-3, form="paper", alpha_from_context=True),
            lambda m: m(x, ctx, ctx, pad)),
        "nn.Intention.query": (ae.nn.Intention(12, 2, alpha_init=1e-3),
                               lambda m: m.query(x, m.condition(ctx, ctx, pad))),
        "nn.InformerLayer": (ae.nn.InformerLayer(12, 2, alpha_init=1e-3), lambda m: m(ctx, pad)),
        "nn.Informer": (ae.nn.Informer(1, 12, 2, alpha_init=1e-3, norm_first=False), lambda m: m(ctx, pad)),
        "IntentionNP": (IntentionNP(d_model=16, num_layers=2, num_heads=2, ff_dim=16, emb_depth=2),
                        lambda m: (lambda d: torch.cat([d.mean, d.stddev], -1))(m.predict(xc, yc, xt))),
        "IntentionNP(intention_form='paper')": (
            IntentionNP(d_model=16, num_layers=2, num_heads=2, ff_dim=16, emb_depth=2, intention_form="paper"),
            lambda m: m.predict(xc, yc, xt).mean),
    }
    return {name: (module.double(), call) for name, (module, call) in cases.items()}


@pytest.mark.parametrize("name", list(_modules()))
def test_compiled_module_equals_eager(name):
    module, call = _modules()[name]
    ridges = [p for n, p in module.named_parameters() if n.endswith("raw_alpha")]
    assert ridges, "the module has no learned ridge"

    def run(fn):
        out = fn(module)
        grads = torch.autograd.grad(out.square().sum(), ridges)
        return [out.detach(), *grads]

    expected = run(call)
    got = run(_compiled(call))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-11)
