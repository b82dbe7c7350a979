"""``ae.SlidingWindowState``: after every update, the exact attention over the last ``window`` keys of the stream
(fp64, against one ``cross_attention`` over them), with padding, chunks longer than the window, before any key;
gradients through the merged state; the window's rows never exceed ``window``; bad arguments named."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attn_ext as ae

F64 = torch.float64


def _stream(B=2, H=2, M=3, N=200, D=8, Dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, M, D, generator=g, dtype=F64), torch.randn(B, H, N, D, generator=g, dtype=F64),
            torch.randn(B, H, N, Dv, generator=g, dtype=F64))


@settings(max_examples=40, deadline=None)
@given(window=st.integers(1, 60), sizes=st.lists(st.integers(0, 80), min_size=1, max_size=8), padded=st.booleans())
def test_equals_attention_over_the_last_window_keys(window, sizes, padded):
    q, k, v = _stream(N=sum(sizes))
    g = torch.Generator().manual_seed(1)
    padding = (torch.rand(2, k.shape[2], generator=g) < 0.2) if padded else None
    s = ae.SlidingWindowState(q, window, dv=6)
    seen = 0
    for n in sizes:
        s.update(k[:, :, seen:seen + n], v[:, :, seen:seen + n],
                 None if padding is None else padding[:, seen:seen + n])
        seen += n
        first = max(0, seen - window)
        assert s.keys_in_window == seen - first <= window
        ref_out, ref_lse = ae.attention_state(q, k[:, :, first:seen], v[:, :, first:seen],
                                              key_padding_mask=None if padding is None else padding[:, first:seen])
        torch.testing.assert_close(s.out, ref_out, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(s.lse, ref_lse, rtol=1e-10, atol=1e-12)


def test_before_any_key_and_after_an_empty_chunk():
    q, k, v = _stream()
    s = ae.SlidingWindowState(q, 10, dv=6)
    assert (s.out == 0).all() and torch.isneginf(s.lse).all() and s.out.shape == (2, 2, 3, 6)
    s.update(k[:, :, :0], v[:, :, :0])
    assert s.keys_in_window == 0 and torch.isneginf(s.lse).all()


def test_gradients_are_those_of_the_window():
    q, k, v = (t.requires_grad_() for t in _stream(N=90))
    s = ae.SlidingWindowState(q, 40)
    for i in range(0, 90, 25):
        s.update(k[:, :, i:i + 25], v[:, :, i:i + 25])
    ref = ae.cross_attention(q, k[:, :, 50:], v[:, :, 50:])
    g = torch.randn_like(ref)
    ours = torch.autograd.grad(s.out, (q, k, v), g)
    theirs = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert (ours[1][:, :, :50] == 0).all()  # keys that left the window


def test_memory_is_the_window():
    q, k, v = _stream(N=1000)
    s = ae.SlidingWindowState(q, 64)
    for i in range(0, 1000, 7):
        s.update(k[:, :, i:i + 7], v[:, :, i:i + 7])
        assert sum(c.k.shape[2] for c in s._chunks) == s.keys_in_window <= 64


@pytest.mark.parametrize("args, match", [
    (dict(window=0), "window"),
    (dict(window=2.5), "window"),
    (dict(window=True), "window"),
])
def test_bad_arguments_are_named(args, match):
    q, _, _ = _stream()
    with pytest.raises(ValueError, match=match):
        ae.SlidingWindowState(q, **args)
    with pytest.raises(ValueError, match="q must be"):
        ae.SlidingWindowState(q[0], 4)
    s = ae.SlidingWindowState(q, 4)
    with pytest.raises(ValueError, match=r"\[B, H, n"):
        s.update(torch.randn(1, 2, 3, 8, dtype=F64), torch.randn(1, 2, 3, 8, dtype=F64))
    s.update(torch.randn(2, 2, 3, 8, dtype=F64), torch.randn(2, 2, 3, 8, dtype=F64))
    with pytest.raises(ValueError, match="width changed"):
        s.update(torch.randn(2, 2, 3, 8, dtype=F64), torch.randn(2, 2, 3, 5, dtype=F64))
