"""Intention with fewer valid keys than D and a small ridge, in float32, against float64 (docs/intention.md,
"Accuracy: which system solves a head").

There ``KᵀK`` is rank deficient and the D×D system in working precision loses about ``u·tr(KᵀK)/α``
(1.5e-3 at α = 1e-3 for D = 32, N = 8; its factorisation even fails further down), while the N×N system
of the same problem is as well conditioned as the keys. Every op must answer such heads to float32
accuracy on every backend that runs here: the default form, σIntention, the fitted map, the convex
regulariser up to the θ where ``exp(−θ)`` rounds to 0, streaming statistics and the pseudo-inverse.
"""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attn_ext as ae
from _helpers import require_backend
from attn_ext.ops.intention.conditioning import PRIMAL_TRACE_PER_ALPHA

F32, F64 = torch.float32, torch.float64
#: Relative error of a float32 answer to these well-conditioned problems (the keys' own condition number
#: is about 10): the dual form gives 2e-7; the D×D system gave 1.5e-3 to 1e-1, or failed.
TOL = 1e-5
BACKENDS = ["reference", "cpp", "triton"]


def few_keys(masked: bool, seed: int = 0):
    """``q, k, v [2, 2, *, 32]`` in float64 with 8 valid keys in batch entry 0; with ``masked``, N = 96 keys
    of which entry 0 pads all but 8 (so N >= D) and entry 1 keeps every key (a batch whose heads differ)."""
    g = torch.Generator().manual_seed(seed)
    N = 96 if masked else 8
    q, k, v = (torch.randn(2, 2, n, d, generator=g, dtype=F64) for n, d in ((5, 32), (N, 32), (N, 6)))
    mask = None
    if masked:
        mask = torch.zeros(2, N, dtype=torch.bool)
        mask[0] = torch.randperm(N, generator=g) >= 8
    return q, k, v, mask


def valid(t: torch.Tensor, mask, b: int) -> torch.Tensor:
    return t[b] if mask is None else t[b][:, ~mask[b]]


def ridge_f64(q, k, v, mask, alpha):
    """``Q (KᵀK + αI)⁻¹ KᵀV`` per batch entry over its valid keys, in float64 (α > 0), from whichever of the
    equal forms ``Q Kᵀ (KKᵀ + αI)⁻¹ V`` (n < D) and the D×D one (n >= D) is the smaller system."""
    out = []
    for b in range(q.shape[0]):
        kb, vb = valid(k, mask, b), valid(v, mask, b)
        n, D = kb.shape[-2:]
        if n < D:
            out.append(q[b] @ kb.mT @ torch.linalg.solve(kb @ kb.mT + alpha * torch.eye(n, dtype=F64), vb))
        else:
            out.append(q[b] @ torch.linalg.solve(kb.mT @ kb + alpha * torch.eye(D, dtype=F64), kb.mT @ vb))
    return torch.stack(out)


def sigma_f64(q, k, v, mask, alpha):
    out = []
    for b in range(q.shape[0]):
        kb, vb = valid(k, mask, b), valid(v, mask, b)
        n, D = kb.shape[-2:]
        if n < D:
            scores = q[b] @ kb.mT @ torch.linalg.inv(kb @ kb.mT + alpha * torch.eye(n, dtype=F64))
        else:
            scores = q[b] @ torch.linalg.inv(kb.mT @ kb + alpha * torch.eye(D, dtype=F64)) @ kb.mT
        out.append(torch.softmax(scores, -1) @ vb)
    return torch.stack(out)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.detach()
    return float(((got.detach().double() - expected).flatten(2).norm(dim=-1) / expected.flatten(2).norm(dim=-1)).max())


def f32(*ts):
    return [t.to(F32) for t in ts]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("alpha", [1e-3, 1e-4])
def test_intention_and_sigma_intention_with_few_keys_are_float32_accurate(backend, masked, alpha):
    q, k, v, mask = few_keys(masked)
    require_backend(backend, q.float())
    out = ae.intention(*f32(q, k, v), alpha=alpha, key_padding_mask=mask, backend=backend)
    assert relative_error(out, ridge_f64(q, k, v, mask, alpha)) < TOL
    out = ae.sigma_intention(*f32(q, k, v), alpha=torch.full((2,), alpha), key_padding_mask=mask, backend=backend)
    assert relative_error(out, sigma_f64(q, k, v, mask, alpha)) < TOL


@pytest.mark.parametrize("backend", ["reference", "cpp"])
def test_gradients_with_few_keys_are_float32_accurate(backend):
    q, k, v, mask = few_keys(True, seed=1)
    alpha = torch.full((2,), 1e-3, dtype=F64, requires_grad=True)
    k64 = k.clone().requires_grad_()
    expected = torch.autograd.grad(ridge_f64(q, k64, v, mask, alpha[0]).square().sum(), k64)[0]
    k32 = k.float().requires_grad_()
    out = ae.intention(q.float(), k32, v.float(), alpha=alpha.float(), key_padding_mask=mask, backend=backend)
    got = torch.autograd.grad(out.square().sum(), k32)[0]
    assert relative_error(got, expected) < 1e-4


@pytest.mark.parametrize("masked", [False, True])
def test_intention_map_with_few_keys_is_float32_accurate(masked):
    q, k, v, mask = few_keys(masked, seed=2)
    eye = torch.eye(32, dtype=F64).expand(2, 2, 32, 32)
    w = ae.intention_map(*f32(k, v), alpha=1e-4, key_padding_mask=mask)
    assert relative_error(w, ridge_f64(eye, k, v, mask, 1e-4)) < TOL


@pytest.mark.parametrize("as_tensor", [False, True])
@pytest.mark.parametrize("theta", [8.0, 10.0, 20.0, 60.0, 103.0])
def test_convex_intention_is_float32_accurate_up_to_where_the_ridge_rounds_to_0(theta, as_tensor):
    q, k, v, mask = few_keys(True, seed=3)
    ridge = math.exp(-theta)
    expected = (1 + ridge) * ridge_f64(q, k, v, mask, ridge)
    th = torch.full((2,), theta) if as_tensor else theta
    out = ae.convex_intention(*f32(q, k, v), theta=th, key_padding_mask=mask)
    assert relative_error(out, expected) < TOL


def test_convex_intention_raises_only_where_the_ridge_rounds_to_0():
    q, k, v, _ = few_keys(False, seed=4)
    # exp(−104) is below half the smallest float32 subnormal: plain least squares, singular with 8 keys.
    for theta in (104.0, torch.full((2,), 104.0)):
        with pytest.raises(RuntimeError, match=r"attn_ext\.convex_intention: theta = .* makes 1 − σ\(theta\) round "
                                               r"to 0 in torch\.float32 .*singular"):
            ae.convex_intention(*f32(q, k, v), theta=theta)


@pytest.mark.parametrize("alpha", [1e-3, 1e-4])
def test_streaming_statistics_with_few_keys_are_float32_accurate(alpha):
    q, k, v, mask = few_keys(True, seed=5)
    expected = ridge_f64(q, k, v, mask, alpha)
    state = ae.intention_state(*f32(k[:, :, :50], v[:, :, :50]), key_padding_mask=mask[:, :50])
    state = ae.update_intention_state(state, *f32(k[:, :, 50:], v[:, :, 50:]), key_padding_mask=mask[:, 50:])
    assert relative_error(ae.intention_from_state(q.float(), state, alpha=alpha), expected) < TOL
    eye = torch.eye(32, dtype=F64).expand(2, 2, 32, 32)
    w = ae.intention_map_from_state(state, alpha=torch.full((2,), alpha))
    assert relative_error(w, ridge_f64(eye, k, v, mask, alpha)) < TOL


def test_module_query_from_a_few_point_context_matches_its_forward_pass():
    torch.manual_seed(0)
    layer = ae.nn.Intention(32, 1, alpha_init=1e-4, learn_alpha=False).double()
    x, ctx = torch.randn(2, 5, 32, dtype=F64), torch.randn(2, 6, 32, dtype=F64)
    expected = layer(x, ctx, ctx)                                   # float64: accurate in either form
    layer, x, ctx = layer.float(), x.float(), ctx.float()
    for got in (layer(x, ctx, ctx), layer.query(x, layer.condition(ctx, ctx))):
        assert relative_error(got[:, None], expected[:, None]) < TOL


@pytest.mark.parametrize("alpha", [1e-3, 1e-2])
def test_pinv_with_few_keys_is_float32_accurate(alpha):
    q, k, v, mask = few_keys(True, seed=6)
    expected = ridge_f64(q, k, v, mask, alpha)       # α > 0: the pseudo-inverse is the inverse
    assert relative_error(ae.pinv_intention(*f32(q, k, v), alpha=alpha, key_padding_mask=mask), expected) < TOL


@pytest.mark.parametrize("backend", ["reference", "cpp"])
@given(data=st.data())
def test_the_fitted_map_is_within_the_documented_bound_whatever_the_keys_and_ridge(backend, data):
    """The map's float32 error is at most a few ``u·(κ + 256)``: ``κ = (σmax² + α)/(σmin² + α)`` over the valid
    keys' singular values (the better conditioned of the two systems) plus the primal's documented extra."""
    require_backend(backend, torch.zeros(1, 1, 1, 1))
    D, N = data.draw(st.integers(2, 32), label="D"), data.draw(st.integers(1, 40), label="N")
    alpha = 10.0 ** data.draw(st.floats(-6, 2), label="log10 alpha")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    k = torch.randn(2, 2, N, D, generator=g, dtype=F64) * 10.0 ** data.draw(st.floats(-1, 1), label="log10 |k|")
    v = torch.randn(2, 2, N, 3, generator=g, dtype=F64)
    mask = torch.rand(2, N, generator=g) < data.draw(st.floats(0, 0.8), label="padding") if N > 1 else None
    eye = torch.eye(D, dtype=F64).expand(2, 2, D, D)
    expected = ridge_f64(eye, k, v, mask, alpha)
    got = ae.intention_map(*f32(k, v), alpha=alpha, key_padding_mask=mask, backend=backend).double()
    for b in range(2):
        s = torch.linalg.svdvals(valid(k, mask, b))
        if s.shape[-1] == 0:
            assert got[b].abs().max() == 0     # no valid key: the map of a regression on nothing
            continue
        kappa = (s.amax(-1) ** 2 + alpha) / (s.amin(-1) ** 2 + alpha)
        error = (got[b] - expected[b]).flatten(1).norm(dim=-1) / expected[b].flatten(1).norm(dim=-1).clamp_min(1e-300)
        bound = 4 * 2.0 ** -24 * (kappa + PRIMAL_TRACE_PER_ALPHA)
        assert (error <= bound).all(), (error, bound)


def test_the_per_head_choice_holds_under_vmap_and_forward_mode():
    """A vmapped ridge whose entries and heads take different forms: each head float32-accurate, and
    forward- and reverse-mode derivatives agree."""
    from torch.func import jacfwd, jacrev, vmap

    q, k, v, mask = few_keys(True, seed=7)
    q, k, v = q[..., :2, :8], k[..., :12, :8], v[..., :12, :2]
    mask = mask[:, :12].clone()
    mask[0] = torch.arange(12) >= 3                                   # 3 valid keys of 8 dimensions
    alphas = torch.tensor([[1e-4, 1e-4], [1e3, 1e3], [1e-4, 1e3]])    # dual, primal, both
    for op, exact in ((ae.intention, ridge_f64), (ae.sigma_intention, sigma_f64)):
        got = vmap(lambda a: op(*f32(q, k, v), alpha=a, key_padding_mask=mask))(alphas)
        small, large = exact(q, k, v, mask, 1e-4), exact(q, k, v, mask, 1e3)
        for out, expected in ((got[0], small), (got[1], large), (got[2], torch.stack([small[:, 0], large[:, 1]], 1))):
            assert relative_error(out, expected) < TOL
        g = lambda kk: op(q, kk, v, alpha=alphas[2].double(), key_padding_mask=mask)  # noqa: E731
        torch.testing.assert_close(jacfwd(g)(k), jacrev(g)(k), rtol=1e-9, atol=1e-9)
