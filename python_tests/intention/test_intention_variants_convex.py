"""The convex regulariser ``σ(θ)KᵀK + (1 − σ(θ))I`` against direct float64 linear algebra, edges and limits."""
import math

import pytest
import torch

import attn_ext as ae

from _intention_problems import BACKENDS, F64, problem as _problem  # noqa: F401


def problem(N=30, D=6, Dv=4, **kwargs):
    return _problem(N=N, D=D, Dv=Dv, **kwargs)


def convex_by_formula(q, k, v, theta, mask=None, scale=1.0):
    """``scale·Q (σKᵀK + (1 − σ)I)⁻¹ KᵀV``, σ = sigmoid(θ), padding keys zeroed, by ``linalg.solve``."""
    if mask is not None:
        k = k.masked_fill(mask[:, None, :, None], 0.0)
        v = v.masked_fill(mask[:, None, :, None], 0.0)
    sigma = torch.sigmoid(torch.as_tensor(theta, dtype=F64)).expand(k.shape[0], k.shape[1])[..., None, None]
    system = sigma * (k.mT @ k) + (1 - sigma) * torch.eye(k.shape[-1], dtype=F64)
    return scale * q @ torch.linalg.solve(system, k.mT @ v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("masked", [False, True])
def test_equals_the_convex_system_solved_directly(backend, masked):
    q, k, v, mask = problem(masked=masked, seed=1)
    theta = torch.tensor([-3.0, 0.0, 2.5], dtype=F64)
    out = ae.convex_intention(q, k, v, theta=theta, key_padding_mask=mask, scale=0.8, backend=backend)
    torch.testing.assert_close(out, convex_by_formula(q, k, v, theta, mask, 0.8), rtol=1e-10, atol=1e-10)
    for t in (-3.0, 1.25):   # a Python float takes the scale route: the same numbers
        torch.testing.assert_close(ae.convex_intention(q, k, v, theta=t, key_padding_mask=mask, backend=backend),
                                   convex_by_formula(q, k, v, t, mask), rtol=1e-10, atol=1e-10)


def test_is_rescaled_ridge_intention():
    q, k, v, _ = problem(seed=2)
    for theta in (-2.0, 0.0, 3.0):
        sigma = 1 / (1 + math.exp(-theta))
        torch.testing.assert_close(ae.convex_intention(q, k, v, theta=theta),
                                   ae.intention(q, k, v, alpha=(1 - sigma) / sigma) / sigma, rtol=1e-12, atol=1e-12)


def test_paper_scaled_form_with_regulariser():
    # The paper's "scaled Intention with a regulariser", written in its N×N (dual) form:
    # Z = 0.5·√D·Q Kᵀ [σ(θ)KKᵀ + (1 − σ(θ))I]⁻¹ V, with θ initialised to 0.
    q, k, v, _ = problem(N=10, D=16, seed=3)
    D, N = 16, 10
    s = ae.intention_variance_scale(D, convex=True)
    system = 0.5 * k @ k.mT + 0.5 * torch.eye(N, dtype=F64)
    paper = s * (q @ k.mT) @ torch.linalg.solve(system, v)
    torch.testing.assert_close(ae.convex_intention(q, k, v, theta=0.0, scale=s), paper, rtol=1e-10, atol=1e-10)
    # ... which at θ = 0 is √D times ridge Intention with α = 1.
    torch.testing.assert_close(paper, ae.intention(q, k, v, alpha=1.0, scale=D ** 0.5), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_match_autograd_of_the_formula(backend):
    q, k, v, mask = problem(B=2, H=2, N=12, D=4, Dv=3, masked=True, seed=4)
    theta = torch.tensor([-1.5, 0.7], dtype=F64)
    mine = [t.clone().requires_grad_() for t in (q, k, v, theta)]
    ref = [t.clone().requires_grad_() for t in (q, k, v, theta)]
    weight = torch.randn(2, 2, 5, 3, dtype=F64, generator=torch.Generator().manual_seed(0))
    out = ae.convex_intention(mine[0], mine[1], mine[2], theta=mine[3], key_padding_mask=mask, backend=backend)
    (out * weight).sum().backward()
    (convex_by_formula(*ref, mask) * weight).sum().backward()
    for got, want in zip(mine, ref):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-9, atol=1e-10)


def test_sigma_to_zero_is_linear_attention():
    q, k, v, _ = problem(seed=5)
    linear = (q @ k.mT) @ v
    # σ = 1e-13: the convex system is I up to σ·KᵀK ~ 1e-11 relative.
    torch.testing.assert_close(ae.convex_intention(q, k, v, theta=-30.0), linear, rtol=1e-9, atol=1e-9)
    for theta in (-1000.0, -math.inf, torch.full((3,), -math.inf, dtype=F64)):   # clamped: the limit itself
        out = ae.convex_intention(q, k, v, theta=theta)
        torch.testing.assert_close(out, linear, rtol=1e-12, atol=1e-12)


def test_sigma_to_zero_in_float32_and_half_precision():
    q, k, v, _ = problem(seed=6)
    linear = (q @ k.mT) @ v
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        out = ae.convex_intention(q.to(dtype), k.to(dtype), v.to(dtype), theta=torch.tensor([-60.0, -40.0, -20.0]))
        assert out.dtype == dtype and torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), linear, rtol=tol, atol=tol * float(linear.abs().max()))


def test_sigma_to_one_is_least_squares_and_raises_where_singular():
    q, k, v, _ = problem(seed=7)
    least_squares = ae.intention(q, k, v, alpha=0.0)
    torch.testing.assert_close(ae.convex_intention(q, k, v, theta=40.0), least_squares, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ae.convex_intention(q, k, v, theta=math.inf), least_squares, rtol=0, atol=0)
    few = problem(N=4, D=6, seed=8)
    with pytest.raises(RuntimeError, match=r"attn_ext\.convex_intention: theta = inf makes 1 − σ\(theta\) round "
                                           r"to 0 .* singular .*attn_ext\.pinv_intention"):
        ae.convex_intention(few[0], few[1], few[2], theta=math.inf)
    # Finite θ keeps 1 − σ > 0: regular, even with fewer keys than dimensions.
    out = ae.convex_intention(few[0], few[1], few[2], theta=5.0)
    torch.testing.assert_close(out, convex_by_formula(few[0], few[1], few[2], 5.0), rtol=1e-10, atol=1e-10)


def test_bad_theta_and_inputs_name_the_op():
    q, k, v, _ = problem(seed=9)
    with pytest.raises(ValueError, match=r"attn_ext\.convex_intention: theta must be real"):
        ae.convex_intention(q, k, v, theta=float("nan"))
    with pytest.raises(ValueError, match=r"attn_ext\.convex_intention: theta must be a float or a tensor "
                                         r"broadcastable to \[B, H\]"):
        ae.convex_intention(q, k, v, theta=torch.zeros(4, dtype=F64))
    with pytest.raises(TypeError, match=r"attn_ext\.convex_intention: theta must be a real floating tensor"):
        ae.convex_intention(q, k, v, theta=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attn_ext\.convex_intention: .*must be 4-D"):
        ae.convex_intention(q[0], k, v)
    with pytest.raises(ValueError, match=r"attn_ext\.convex_intention: unknown form"):
        ae.convex_intention(q, k, v, form="both")
