"""Attention states with the causal rule and sliding windows by position (``is_causal``, ``window_size``,
``query_start``, ``key_start``): built from chunks, merged, streamed and downdated, they equal one attention over
all the keys with the band as an explicit bool mask (fp64), gradients included; bad positions raise errors
naming the op and the argument."""
from __future__ import annotations

import pytest
import torch

import attn_ext as ae

B, H, M, N, D = 1, 2, 6, 90, 8


def _qkv(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, M, D, generator=gen, dtype=torch.float64),
            torch.randn(B, H, N, D, generator=gen, dtype=torch.float64),
            torch.randn(B, H, N, D, generator=gen, dtype=torch.float64))


def _band_mask(query_start, left, right):
    """bool [M, N], True = takes part: qpos − left ≤ kpos ≤ qpos + right (None: unbounded)."""
    qpos = torch.arange(M).view(M, 1) + query_start
    kpos = torch.arange(N).view(1, N)
    ok = torch.ones(M, N, dtype=torch.bool)
    if left is not None:
        ok &= kpos >= qpos - left
    if right is not None:
        ok &= kpos <= qpos + right
    return ok


CASES = [  # (is_causal, window_size, query_start, (left, right) of the explicit mask)
    (True, None, 40, (None, 0)),
    (False, (20, 5), 50, (20, 5)),
    (True, (30, -1), 84, (30, 0)),
    (False, (-1, 3), 0, (None, 3)),
    (True, (10, 0), -3, (10, 0)),  # the first queries before key 0: some rows see no key
]


def _reference(q, k, v, case):
    is_causal, window, start, (left, right) = case
    mask = _band_mask(start, left, right)
    out, lse = ae.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True, backend="reference")
    return out, lse


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("split", [(90,), (25, 40, 25), (7, 1, 60, 22)])
def test_chunks_streamed_and_updated_equal_one_banded_attention(case, split):
    q, k, v = _qkv()
    is_causal, window, start, _ = case
    out_ref, lse_ref = _reference(q, k, v, case)
    bounds = torch.tensor([0, *split]).cumsum(0).tolist()
    chunks = [(k[:, :, a:b], v[:, :, a:b]) for a, b in zip(bounds, bounds[1:])]
    streamed = ae.stream_attention(q, iter(chunks), is_causal=is_causal, window_size=window, query_start=start)
    state = ae.empty_state(q, D)
    for (kc, vc), a in zip(chunks, bounds):
        state = ae.update_state(state, q, kc, vc, is_causal=is_causal, window_size=window, query_start=start,
                                key_start=a)
    for got in (streamed, state):
        torch.testing.assert_close(got.out, out_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got.lse, lse_ref, rtol=1e-12, atol=1e-12)


def test_remove_takes_back_a_banded_chunk():
    q, k, v = _qkv(1)
    kw = dict(is_causal=True, window_size=(50, 0), query_start=60)
    full = ae.attention_state(q, k, v, **kw)
    kept = ae.attention_state(q, k[:, :, :70], v[:, :, :70], **kw)
    removed = ae.remove_from_state(full, q, k[:, :, 70:], v[:, :, 70:], key_start=70, **kw)
    torch.testing.assert_close(removed.out, kept.out, rtol=1e-9, atol=1e-9)


def test_gradients_of_a_banded_state_equal_the_masked_attention():
    q, k, v = (t.requires_grad_() for t in _qkv(2))
    case = CASES[1]
    st = ae.update_state(ae.attention_state(q, k[:, :, :45], v[:, :, :45], window_size=(20, 5), query_start=50),
                         q, k[:, :, 45:], v[:, :, 45:], window_size=(20, 5), query_start=50, key_start=45)
    ref, _ = _reference(q, k, v, case)
    g = torch.randn_like(ref)
    got = torch.autograd.grad(st.out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    small = [t.detach()[..., :3, :].clone().requires_grad_() if i == 0 else t.detach()[:, :, :12].clone()
             .requires_grad_() for i, t in enumerate((q, k, v))]
    assert torch.autograd.gradcheck(
        lambda q, k, v: ae.attention_state(q, k, v, is_causal=True, window_size=(4, 0), query_start=5, key_start=2).out,
        small)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(query_start=1.5), TypeError, "attn_ext.attention_state: query_start must be an int"),
    (dict(key_start=True), TypeError, "attn_ext.attention_state: key_start must be an int"),
    (dict(is_causal=1), TypeError, "attn_ext.attention_state: is_causal must be a bool"),
    (dict(window_size=(3,)), TypeError, "attn_ext.attention_state: window_size must be a pair"),
    (dict(is_causal=True, window_size=(3, 2)), ValueError, "attn_ext.attention_state: is_causal=True lets no query"),
])
def test_bad_positions_name_the_op_and_argument(kwargs, error, match):
    q, k, v = _qkv()
    with pytest.raises(error, match=match):
        ae.attention_state(q, k, v, **kwargs)
