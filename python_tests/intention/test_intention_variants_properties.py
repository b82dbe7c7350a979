"""Property tests of Intention and its variants over random shapes, masks, chunkings and ridges.

The fixed-case tests check each function against a float64 formula at a few shapes; these check
the algebra that must hold at every shape (odd head dims, one key, more dimensions than keys):
the ops equal their float64 definitions, streamed statistics in any chunking equal one shot,
padding equals dropping the keys, the output is linear in V and blind to the key order, and the
pseudo-inverse answer is the minimum-norm least-squares one. float64 throughout, with tolerances
far above its rounding and far below any wrong weight.
"""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attn_ext as ae

from _intention_problems import draw_problem

F64 = torch.float64
TOL = dict(rtol=1e-7, atol=1e-8)
VARIANTS = ("intention", "convex", "pinv", "kernel_exact", "kernel_nystrom")


@st.composite
def problems(draw, max_keys=24, max_dim=9):
    """``(q, k, v, mask, alpha)``: :func:`draw_problem` with 1 <= N <= max_keys and a ridge α in [0.05, 5]."""
    return (*draw_problem(draw, min_keys=1, max_keys=max_keys, max_dim=max_dim), draw(st.floats(0.05, 5.0)))


def run(variant, q, k, v, mask, alpha):
    if variant == "intention":
        return ae.intention(q, k, v, alpha=alpha, key_padding_mask=mask)
    if variant == "convex":                       # θ with exp(−θ) = α: the rescaled ridge system
        theta = -torch.log(torch.tensor(alpha, dtype=F64)).item()
        return ae.convex_intention(q, k, v, theta=theta, key_padding_mask=mask)
    if variant == "pinv":
        return ae.pinv_intention(q, k, v, alpha=alpha, key_padding_mask=mask)
    if variant == "kernel_exact":
        return ae.kernelised_intention(q, k, v, alpha=alpha, lengthscale=1.5, key_padding_mask=mask)
    # Two landmarks (evenly spaced over the valid keys, so padding or dropping keys picks the same
    # ones); with no keys at all there is nothing to pick, and the exact form's answer, 0, is the same.
    return ae.kernelised_intention(q, k, v, alpha=alpha, lengthscale=1.5, key_padding_mask=mask,
                                   num_landmarks=min(2, k.shape[2]) or None, jitter=1e-6)


def ridge_formula(q, k, v, mask, alpha, feature=None):
    """``φ(Q) (φ(K)ᵀφ(K) + αI)⁻¹ φ(K)ᵀV`` over the valid keys, per (batch, head), by ``torch.linalg.solve``."""
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=F64)
    for b in range(q.shape[0]):
        keep = slice(None) if mask is None else ~mask[b]
        for h in range(q.shape[1]):
            kb, vb = k[b, h][keep], v[b, h][keep]
            system = kb.mT @ kb + alpha * torch.eye(kb.shape[-1], dtype=F64)
            out[b, h] = q[b, h] @ torch.linalg.solve(system, kb.mT @ vb)
    return out


@given(problems())
def test_intention_convex_and_pinv_equal_the_ridge_formula(case):
    q, k, v, mask, alpha = case
    want = ridge_formula(q, k, v, mask, alpha)
    torch.testing.assert_close(run("intention", q, k, v, mask, alpha), want, **TOL)
    torch.testing.assert_close(run("pinv", q, k, v, mask, alpha), want, **TOL)
    # σKᵀK + (1 − σ)I = σ(KᵀK + αI) with α = e^{−θ}: the convex form is (1 + α) times the ridge answer.
    torch.testing.assert_close(run("convex", q, k, v, mask, alpha), (1 + alpha) * want, **TOL)


@given(problems())
def test_exact_kernelised_form_is_kernel_ridge_regression(case):
    q, k, v, mask, alpha = case
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=F64)
    rbf = lambda x, y: torch.exp(-torch.cdist(x, y) ** 2 / (2 * 1.5 ** 2))
    for b in range(q.shape[0]):
        keep = slice(None) if mask is None else ~mask[b]
        for h in range(q.shape[1]):
            kb, vb = k[b, h][keep], v[b, h][keep]
            out[b, h] = rbf(q[b, h], kb) @ torch.linalg.solve(rbf(kb, kb) + alpha * torch.eye(len(kb), dtype=F64), vb)
    torch.testing.assert_close(run("kernel_exact", q, k, v, mask, alpha), out, **TOL)


@pytest.mark.parametrize("variant", VARIANTS)
@given(case=problems(), a=st.floats(-2, 2), c=st.floats(-2, 2))
def test_output_is_linear_in_the_values(variant, case, a, c):
    q, k, v, mask, alpha = case
    w = torch.randn(v.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    combined = run(variant, q, k, a * v + c * w, mask, alpha)
    torch.testing.assert_close(combined, a * run(variant, q, k, v, mask, alpha) + c * run(variant, q, k, w, mask, alpha),
                               **TOL)


@pytest.mark.parametrize("variant", VARIANTS[:4])   # Nyström's evenly spaced landmarks depend on the order
@given(case=problems(), seed=st.integers(0, 2**16))
def test_key_order_does_not_matter(variant, case, seed):
    q, k, v, mask, alpha = case
    perm = torch.randperm(k.shape[2], generator=torch.Generator().manual_seed(seed))
    shuffled = run(variant, q, k[:, :, perm], v[:, :, perm], None if mask is None else mask[:, perm], alpha)
    torch.testing.assert_close(shuffled, run(variant, q, k, v, mask, alpha), **TOL)


@pytest.mark.parametrize("variant", VARIANTS)
@given(problems())
def test_padding_equals_dropping_the_keys_even_if_they_hold_nan(variant, case):
    q, k, v, mask, alpha = case
    if mask is None:                    # pad the last key of batch 0 (when there is another one)
        mask = torch.zeros(q.shape[0], k.shape[2], dtype=torch.bool)
        mask[0, -1] = k.shape[2] > 1
    poisoned_k = k.masked_fill(mask[:, None, :, None], float("nan"))
    poisoned_v = v.masked_fill(mask[:, None, :, None], float("inf"))
    padded = run(variant, q, poisoned_k, poisoned_v, mask, alpha)
    for b in range(q.shape[0]):
        keep = ~mask[b]
        dropped = run(variant, q[b:b + 1], k[b:b + 1, :, keep], v[b:b + 1, :, keep], None, alpha)
        torch.testing.assert_close(padded[b:b + 1], dropped, **TOL)


@st.composite
def chunkings(draw, n):
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=4))) if n > 1 else []
    bounds = [0, *cuts, n]
    return list(zip(bounds[:-1], bounds[1:]))


@given(case=problems(), data=st.data())
def test_streamed_merged_and_downdated_maps_equal_one_shot(case, data):
    q, k, v, _, alpha = case
    spans = data.draw(chunkings(k.shape[2]))
    states = [ae.intention_state(k[:, :, a:b], v[:, :, a:b]) for a, b in spans]
    merged = states[0]
    for s in states[1:]:
        merged = ae.merge_intention_states(merged, s)
    extra_k, extra_v = torch.randn_like(k[:, :, :3]), torch.randn_like(v[:, :, :3])
    added_then_removed = ae.remove_from_intention_state(ae.update_intention_state(merged, extra_k, extra_v),
                                                        extra_k, extra_v)
    one_shot = ae.intention_map(k, v, alpha=alpha)
    for state in (merged, added_then_removed):
        torch.testing.assert_close(ae.intention_map_from_state(state, alpha=alpha), one_shot, **TOL)
    torch.testing.assert_close(q @ one_shot, ae.intention(q, k, v, alpha=alpha), **TOL)


@given(case=problems(max_keys=6), extra_dims=st.integers(0, 4))
def test_pinv_map_is_the_minimum_norm_least_squares_solution(case, extra_dims):
    # Few keys, or duplicated key features: KᵀK is singular and α = 0 has no unique solution.
    _, k, v, _, _ = case
    k = torch.cat([k, k[..., :1].expand(*k.shape[:3], extra_dims)], dim=-1)
    w = ae.intention_map(k, v, alpha=0.0, pinv=True)
    # The map comes from the eigenvalues of KᵀK, which square K's condition number κ (over the
    # singular values pinv keeps): its rounding error grows like eps·κ², so the tolerance does too.
    sv = torch.linalg.svdvals(k)
    kept = torch.where(sv ** 2 > k.shape[-1] * torch.finfo(F64).eps * sv[..., :1] ** 2, sv, sv[..., :1])  # pinv's rtol
    kappa = float((sv[..., :1] / kept).max())
    atol = 1e3 * torch.finfo(F64).eps * kappa ** 2 * (1 + float(w.abs().max()) + float(v.abs().max()))
    residual = k @ w - v
    torch.testing.assert_close(k.mT @ residual, torch.zeros_like(w), rtol=0, atol=atol)   # normal equations
    # Minimum norm: w lies in the row space of K (no component in K's null space).
    projector = torch.linalg.pinv(k) @ k
    torch.testing.assert_close(projector @ w, w, rtol=0, atol=atol)
