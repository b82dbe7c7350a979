"""Property tests of the attention-state algebra (docs/spec.md §1): chunkings, update orders, merge trees,
removal and gradients all agree with one-shot attention over the union of the keys.

The properties are about algebra, not rounding, so they run in fp64 (cpp and reference support it)
with a tolerance a thousand times the fp64 rounding error; a wrong weight anywhere in a merge
shows up at the 1e-3 level. One fp32 case per property checks the same with the FlashAttention rule.
"""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attn_ext as ae
from attn_ext.ops.attention.state import DEFAULT_MIN_REMAINING

from _helpers import assert_within_flash_rule, naive_attention

B, H, M, D, DV = 2, 2, 5, 8, 6
ATOL64 = 1e-11
STATE_BACKENDS = ("cpp", "reference")


def _keys(n, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, M, D, generator=g, dtype=dtype)
    k = torch.randn(B, H, n, D, generator=g, dtype=dtype)
    v = torch.randn(B, H, n, DV, generator=g, dtype=dtype)
    return q, k, v


def _assert_state_close(state, out, lse, atol=ATOL64):
    torch.testing.assert_close(state.out, out, atol=atol, rtol=0)
    finite = torch.isfinite(lse)
    assert torch.equal(torch.isfinite(state.lse), finite)
    torch.testing.assert_close(state.lse[finite], lse[finite], atol=atol, rtol=0)


@st.composite
def chunkings(draw, max_keys=60, max_chunks=6):
    n = draw(st.integers(1, max_keys))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=max_chunks - 1))) if n > 1 else []
    bounds = [0, *cuts, n]
    return n, list(zip(bounds[:-1], bounds[1:]))


@pytest.mark.parametrize("backend", STATE_BACKENDS)
@given(chunking=chunkings(), order_seed=st.integers(0, 2**16), seed=st.integers(0, 2**16))
def test_updates_in_any_order_equal_one_shot(backend, chunking, order_seed, seed):
    n, spans = chunking
    q, k, v = _keys(n, seed)
    order = torch.randperm(len(spans), generator=torch.Generator().manual_seed(order_seed)).tolist()
    state = ae.empty_state(q, DV)
    for i in order:
        a, b = spans[i]
        state = ae.update_state(state, q, k[:, :, a:b], v[:, :, a:b], backend=backend)
    out, lse = naive_attention(q, k, v)
    _assert_state_close(state, out, lse)


@pytest.mark.parametrize("backend", STATE_BACKENDS)
@given(chunking=chunkings(), tree_seed=st.integers(0, 2**16), seed=st.integers(0, 2**16))
def test_any_merge_tree_equals_one_shot(backend, chunking, tree_seed, seed):
    n, spans = chunking
    q, k, v = _keys(n, seed)
    states = [ae.attention_state(q, k[:, :, a:b], v[:, :, a:b], backend=backend) for a, b in spans]
    g = torch.Generator().manual_seed(tree_seed)
    while len(states) > 1:  # merge a random pair, in a random order, until one state is left
        i, j = torch.randperm(len(states), generator=g)[:2].tolist()
        merged = ae.merge_states(states[i], states[j], backend=backend)
        states = [s for t, s in enumerate(states) if t not in (i, j)] + [merged]
    out, lse = naive_attention(q, k, v)
    _assert_state_close(states[0], out, lse)


@pytest.mark.parametrize("backend", STATE_BACKENDS)
@given(sizes=st.tuples(st.integers(1, 20), st.integers(1, 20), st.integers(1, 20)), seed=st.integers(0, 2**16))
def test_merge_is_associative_commutative_with_identity(backend, sizes, seed):
    q, k, v = _keys(sum(sizes), seed)
    bounds = [0, sizes[0], sizes[0] + sizes[1], sum(sizes)]
    a, b, c = (ae.attention_state(q, k[:, :, s:e], v[:, :, s:e], backend=backend) for s, e in zip(bounds, bounds[1:]))
    merge = lambda x, y: ae.merge_states(x, y, backend=backend)  # noqa: E731
    left, right = merge(merge(a, b), c), merge(a, merge(b, c))
    _assert_state_close(left, right.out, right.lse)
    swapped = merge(b, a)
    _assert_state_close(swapped, *merge(a, b))
    identity = ae.empty_state(q, DV)
    # Merging with the identity is exact: its weight is exp(-inf) = 0 and the other's is exactly 1.
    for s in (merge(a, identity), merge(identity, a)):
        assert torch.equal(s.out, a.out) and torch.equal(s.lse, a.lse)


@pytest.mark.parametrize("backend", STATE_BACKENDS)
@given(n_keep=st.integers(1, 30), n_remove=st.integers(1, 30), seed=st.integers(0, 2**16))
def test_update_then_remove_returns_to_the_earlier_state(backend, n_keep, n_remove, seed):
    q, k, v = _keys(n_keep + n_remove, seed)
    kept = ae.attention_state(q, k[:, :, :n_keep], v[:, :, :n_keep], backend=backend)
    grown = ae.update_state(kept, q, k[:, :, n_keep:], v[:, :, n_keep:], backend=backend)
    removed = ae.attention_state(q, k[:, :, n_keep:], v[:, :, n_keep:], backend=backend)
    remaining = 1 - torch.exp(removed.lse - grown.lse)
    if float(remaining.min()) < DEFAULT_MIN_REMAINING:
        with pytest.raises(ValueError, match=r"^attn_ext\.remove_from_state: would leave"):
            ae.remove_from_state(grown, q, k[:, :, n_keep:], v[:, :, n_keep:], backend=backend)
        return
    back = ae.remove_from_state(grown, q, k[:, :, n_keep:], v[:, :, n_keep:], backend=backend)
    # Removal divides by the remaining mass, amplifying the rounding error by at most 1/remaining.
    _assert_state_close(back, kept.out, kept.lse, atol=ATOL64 / float(remaining.min()))


@pytest.mark.parametrize("backend", STATE_BACKENDS)
@given(chunking=chunkings(max_keys=30, max_chunks=4), seed=st.integers(0, 2**16))
def test_gradients_through_updates_equal_one_shot(backend, chunking, seed):
    n, spans = chunking
    q, k, v = (t.requires_grad_() for t in _keys(n, seed))
    state = ae.empty_state(q, DV)
    for a, b in spans:
        state = ae.update_state(state, q, k[:, :, a:b], v[:, :, a:b], backend=backend)
    g = torch.Generator().manual_seed(seed + 1)
    grad_out, grad_lse = torch.randn(B, H, M, DV, generator=g, dtype=q.dtype), torch.randn(B, H, M, generator=g, dtype=q.dtype)
    ours = torch.autograd.grad((state.out * grad_out).sum() + (state.lse * grad_lse).sum(), (q, k, v))
    out, lse = naive_attention(q, k, v)
    expected = torch.autograd.grad((out * grad_out).sum() + (lse * grad_lse).sum(), (q, k, v))
    for name, a, b in zip("qkv", ours, expected):
        torch.testing.assert_close(a, b, atol=ATOL64 * 10, rtol=0, msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("backend", STATE_BACKENDS)
def test_fp32_streamed_state_meets_the_flash_rule(backend):
    q, k, v = _keys(3000, seed=7, dtype=torch.float32)
    chunks = ((k[:, :, i:i + 256], v[:, :, i:i + 256]) for i in range(0, 3000, 256))
    state = ae.stream_attention(q, chunks, backend=backend)
    ref_out, ref_lse = naive_attention(q.double(), k.double(), v.double())
    pt_out, pt_lse = naive_attention(q, k, v)
    assert_within_flash_rule(state.out, ref_out, pt_out, name="out")
    assert_within_flash_rule(state.lse, ref_lse, pt_lse, name="lse")


def test_merge_weights_are_stable_for_huge_lse():
    """Equal log-sum-exps of 1e30 must weigh 1/2 each, not exp(0) = 1 each."""
    out_a, out_b = torch.ones(1, 1, 1, 2), 3 * torch.ones(1, 1, 1, 2)
    lse = torch.full((1, 1, 1), 1e30)
    merged = ae.merge_states(ae.AttentionState(out_a, lse), ae.AttentionState(out_b, lse.clone()), backend="cpp")
    torch.testing.assert_close(merged.out, 2 * torch.ones(1, 1, 1, 2))
    assert math.isclose(float(merged.lse), 1e30, rel_tol=1e-6)
