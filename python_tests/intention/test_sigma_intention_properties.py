"""Property tests of σIntention, ``softmax(scale·Q (KᵀK + αI)⁻¹ Kᵀ) V``, over random shapes and masks.

Each property holds at every shape (odd head dims, one key, more dimensions than keys, no valid
key): the op equals its float64 definition on both CPU backends, padding equals dropping the keys
whatever they hold, the key order does not matter, and every output row is a convex combination of
the valid values. float64, tolerances far above rounding and far below a wrong weight.
"""
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import attn_ext as ae

from _intention_problems import draw_problem

F64 = torch.float64
TOL = dict(rtol=1e-8, atol=1e-9)
BACKENDS = ("cpp", "reference")


@st.composite
def problems(draw, max_keys=20, max_dim=9):
    """``(q, k, v, mask, alpha, scale)``: :func:`draw_problem` with 0 <= N <= max_keys, α and a query scale."""
    return (*draw_problem(draw, min_keys=0, max_keys=max_keys, max_dim=max_dim), draw(st.floats(0.05, 5.0)),
            draw(st.floats(0.1, 3.0)))


def definition(q, k, v, mask, alpha, scale):
    """Per (batch, head) over the valid keys, by ``torch.linalg.solve``; 0 for a row with no valid key."""
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=F64)
    for b in range(q.shape[0]):
        keep = torch.ones(k.shape[2], dtype=torch.bool) if mask is None else ~mask[b]
        if not bool(keep.any()):
            continue
        for h in range(q.shape[1]):
            kb, vb = k[b, h][keep], v[b, h][keep]
            q_tilde = torch.linalg.solve(kb.mT @ kb + alpha * torch.eye(kb.shape[-1], dtype=F64), scale * q[b, h].mT).mT
            out[b, h] = torch.softmax(q_tilde @ kb.mT, dim=-1) @ vb
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@given(problems())
def test_equals_its_definition(backend, case):
    q, k, v, mask, alpha, scale = case
    out = ae.sigma_intention(q, k, v, alpha=alpha, key_padding_mask=mask, scale=scale, backend=backend)
    torch.testing.assert_close(out, definition(q, k, v, mask, alpha, scale), **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=problems(), seed=st.integers(0, 2**16))
def test_padding_is_dropping_and_order_does_not_matter(backend, case, seed):
    q, k, v, mask, alpha, scale = case
    assume(mask is not None)
    poisoned = (k.masked_fill(mask[:, None, :, None], float("nan")), v.masked_fill(mask[:, None, :, None], float("inf")))
    out = ae.sigma_intention(q, *poisoned, alpha=alpha, key_padding_mask=mask, scale=scale, backend=backend)
    for b in range(q.shape[0]):
        keep = ~mask[b]
        dropped = ae.sigma_intention(q[b:b + 1], k[b:b + 1, :, keep], v[b:b + 1, :, keep], alpha=alpha, scale=scale,
                                     backend=backend)
        torch.testing.assert_close(out[b:b + 1], dropped, **TOL)
    perm = torch.randperm(k.shape[2], generator=torch.Generator().manual_seed(seed))
    shuffled = ae.sigma_intention(q, k[:, :, perm], v[:, :, perm], alpha=alpha, key_padding_mask=mask[:, perm],
                                  scale=scale, backend=backend)
    torch.testing.assert_close(shuffled, ae.sigma_intention(q, k, v, alpha=alpha, key_padding_mask=mask, scale=scale,
                                                            backend=backend), **TOL)


@given(problems())
def test_rows_are_convex_combinations_of_the_valid_values(case):
    q, k, v, mask, alpha, scale = case
    out = ae.sigma_intention(q, k, v, alpha=alpha, key_padding_mask=mask, scale=scale)
    for b in range(q.shape[0]):
        keep = torch.ones(k.shape[2], dtype=torch.bool) if mask is None else ~mask[b]
        if not bool(keep.any()):
            assert torch.equal(out[b], torch.zeros_like(out[b]))      # no valid key: 0, like attention
            continue
        valid = v[b][:, keep]                                          # [H, n, Dv]
        low, high = valid.amin(1, keepdim=True), valid.amax(1, keepdim=True)
        assert bool(((out[b] >= low - 1e-12) & (out[b] <= high + 1e-12)).all())
