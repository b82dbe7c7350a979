"""Sliding windows and the causal rule's alignment (``window_size``, ``alignment`` of
``ae.scaled_dot_product_attention``; ``torch.nn.attention.bias.CausalBias``): every backend against the dense fp64
composition with the band written out as a bool mask, the FlashAttention rule in fp32/fp16/bf16, the band
combined with masks, key padding, grouped heads and dropout, derivatives of every order, opcheck, and an error
naming the argument for every refused combination."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import attn_ext as ae
from _helpers import assert_within_flash_rule
from _sdpa_ref import attention_ops, backends, dense_attention, require

F64 = torch.float64


def band_mask(L, S, is_causal=False, window=None, alignment="top_left"):
    """The band as a bool ``[L, S]`` mask, written from the definition: query i's diagonal key i' = i (top-left)
    or i + S - L (bottom-right); key j takes part iff i' - left <= j <= i' + right (-1: no limit), and j <= i'
    with the causal rule."""
    diag = (S - L) if alignment == "bottom_right" else 0
    i = torch.arange(L).view(L, 1) + diag
    j = torch.arange(S).view(1, S)
    ok = torch.ones(L, S, dtype=torch.bool)
    left, right = window if window is not None else (-1, -1)
    if is_causal:
        ok &= j <= i
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def _qkv(B, Hq, Hkv, L, S, D, Dv, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, L, D, generator=g).to(dtype), torch.randn(B, Hkv, S, D, generator=g).to(dtype),
            torch.randn(B, Hkv, S, Dv, generator=g).to(dtype))


BANDS = [  # is_causal, window_size, alignment
    (False, (4, 0), "top_left"),
    (False, (0, 3), "top_left"),
    (False, (6, 6), "bottom_right"),
    (False, (-1, 2), "bottom_right"),
    (True, None, "bottom_right"),
    (True, (5, -1), "top_left"),
    (True, (0, 0), "bottom_right"),
    (True, (9, 0), "bottom_right"),
]
SHAPES = [  # B, Hq, Hkv, L, S, D, Dv: L < S, L > S (bottom-right: rows before the keys are empty), one query
    (2, 4, 2, 23, 70, 16, 8),
    (1, 2, 2, 45, 19, 9, 12),
    (2, 2, 1, 1, 33, 8, 8),
]


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("band", BANDS, ids=str)
@pytest.mark.parametrize("chunk_size", [8, 512])
def test_equals_the_band_as_a_mask_fp64(backend, shape, band, chunk_size):
    B, Hq, Hkv, L, S, D, Dv = shape
    is_causal, window, alignment = band
    q, k, v = (t.requires_grad_() for t in _qkv(B, Hq, Hkv, L, S, D, Dv))
    require(backend, q)
    out, lse = ae.scaled_dot_product_attention(q, k, v, is_causal=is_causal, window_size=window, alignment=alignment,
                                               enable_gqa=Hq != Hkv, chunk_size=chunk_size, return_lse=True,
                                               backend=backend)
    mask = band_mask(L, S, is_causal, window, alignment)
    ref, ref_lse = dense_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-12)
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), g)
    theirs = torch.autograd.grad(ref, (q, k, v), g)
    for a, b, name in zip(ours, theirs, "qkv"):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
# Not the one-key window (0, 0): there dQ is exactly 0 (a softmax over one key), which PyTorch's dense backward
# gets exactly and the FlashAttention backward only to rounding (its dP - Δ cancels), with no scale for the floor.
@pytest.mark.parametrize("band", [BANDS[0], BANDS[3], BANDS[7]], ids=str)
def test_flash_rule(backend, dtype, band):
    is_causal, window, alignment = band
    B, Hq, Hkv, L, S, D, Dv = 2, 4, 2, 40, 90, 32, 24
    q64, k64, v64 = _qkv(B, Hq, Hkv, L, S, D, Dv)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q64, k64, v64))
    require(backend, q)
    mask = band_mask(L, S, is_causal, window, alignment)
    out, lse = ae.scaled_dot_product_attention(q, k, v, is_causal=is_causal, window_size=window, alignment=alignment,
                                               enable_gqa=True, chunk_size=16, return_lse=True, backend=backend)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = dense_attention(*leaves64, attn_mask=mask)
    same = [t.detach().requires_grad_() for t in (q, k, v)]
    pt, pt_lse = dense_attention(*same, attn_mask=mask)
    assert_within_flash_rule(out.detach(), ref.detach(), pt.detach(), name="out")
    assert_within_flash_rule(lse.detach(), ref_lse.detach(), pt_lse.detach(), name="lse")
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    for a, r, p, name in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, leaves64, g.double()),
                             torch.autograd.grad(pt, same, g), "qkv"):
        assert_within_flash_rule(a, r, p, grad=True, name=f"d{name}")


@pytest.mark.parametrize("backend", backends())
def test_combines_with_masks_padding_and_dropout(backend):
    B, Hq, Hkv, L, S, D, Dv = 2, 4, 2, 30, 50, 8, 8
    q, k, v = (t.requires_grad_() for t in _qkv(B, Hq, Hkv, L, S, D, Dv))
    require(backend, q)
    g = torch.Generator().manual_seed(7)
    float_mask = torch.randn(1, Hq, L, S, generator=g, dtype=F64)
    bool_mask = torch.rand(B, 1, L, S, generator=g) > 0.2
    padding = torch.zeros(B, S, dtype=torch.bool)
    padding[1, -7:] = True
    band = band_mask(L, S, False, (6, 2), "bottom_right")
    for attn_mask in (float_mask, bool_mask):
        out = ae.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, window_size=(6, 2),
                                              alignment="bottom_right", key_padding_mask=padding, enable_gqa=True,
                                              chunk_size=8, backend=backend)
        combined = attn_mask & band if attn_mask.dtype == torch.bool else attn_mask.masked_fill(~band, -math.inf)
        ref, _ = dense_attention(q, k, v, attn_mask=combined, key_padding_mask=padding)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    # Dropout: the keep mask is the same counter-based draw as without a band, applied to the band's pairs.
    torch.manual_seed(11)
    out = ae.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True, window_size=(5, 0),
                                          enable_gqa=True, chunk_size=8, backend=backend)
    torch.manual_seed(11)
    full = ae.scaled_dot_product_attention(q, k, v, attn_mask=band_mask(L, S, True, (5, 0)), dropout_p=0.3,
                                           enable_gqa=True, chunk_size=8, backend="reference")
    torch.testing.assert_close(out, full, rtol=1e-10, atol=1e-12)


def test_the_float_mask_gradient_through_a_window():
    # A learned bias differentiated with a window: the composite, with the band's masked pairs' gradient 0.
    q, k, v = _qkv(1, 2, 2, 12, 20, 8, 8)
    bias = torch.randn(1, 2, 12, 20, dtype=F64, requires_grad=True)
    out = ae.scaled_dot_product_attention(q, k, v, attn_mask=bias, window_size=(3, 1), chunk_size=4)
    ref, _ = dense_attention(q, k, v, attn_mask=bias.masked_fill(~band_mask(12, 20, False, (3, 1)), -math.inf))
    g = torch.randn_like(out)
    (ours,), (theirs,) = torch.autograd.grad(out, bias, g), torch.autograd.grad(ref, bias, g)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    assert (ours[0, :, ~band_mask(12, 20, False, (3, 1))] == 0).all()


@pytest.mark.parametrize("backend", backends())
def test_gradcheck_and_gradgradcheck(backend):
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 1, 7, 11, 4, 3))
    require(backend, q)

    def f(q, k, v):
        return ae.scaled_dot_product_attention(q, k, v, is_causal=True, window_size=(2, 0), alignment="bottom_right",
                                               enable_gqa=True, chunk_size=4, return_lse=True, backend=backend)

    assert torch.autograd.gradcheck(f, (q, k, v))
    assert torch.autograd.gradgradcheck(f, (q, k, v))
    # forward mode too
    tangents = tuple(torch.randn_like(t) for t in (q, k, v))
    _, jvp = torch.func.jvp(lambda *a: f(*a)[0], (q.detach(), k.detach(), v.detach()), tangents)
    ref = torch.func.jvp(lambda q, k, v: dense_attention(q, k, v, attn_mask=band_mask(7, 11, True, (2, 0),
                                                                                      "bottom_right"))[0],
                         (q.detach(), k.detach(), v.detach()), tangents)[1]
    torch.testing.assert_close(jvp, ref, rtol=1e-9, atol=1e-11)


def test_opcheck_with_the_band_arguments():
    q, k, v = _qkv(1, 2, 2, 9, 13, 8, 8, dtype=torch.float32)
    for op in attention_ops():
        torch.library.opcheck(op, (q, k, v, None, None, 0.3, True, 0.0, None, 4, 3, -1, 4))
        torch.library.opcheck(op, (q, k, v, None, None, 0.3, False, 0.0, None, 4, 2, 5, 0))


def test_causal_bias_lower_right_is_the_bottom_right_causal_rule():
    for L, S in ((10, 25), (25, 10)):
        q, k, v = _qkv(2, 2, 2, L, S, 8, 8)
        ours = ae.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(L, S), chunk_size=4)
        same = ae.scaled_dot_product_attention(q, k, v, is_causal=True, alignment="bottom_right", chunk_size=4)
        torch.testing.assert_close(ours, same, rtol=0, atol=0)
        ref, _ = dense_attention(q, k, v, attn_mask=band_mask(L, S, True, None, "bottom_right"))
        torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
        if L <= S:  # PyTorch's own (its rows before the first key would be NaN in older versions)
            theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(L, S))
            torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    upper = ae.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(25, 10))
    torch.testing.assert_close(upper, ae.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=0, atol=0)


def test_rows_before_the_first_key_are_empty():
    # Bottom-right with L > S: queries 0 .. L - S - 1 sit before key 0 and see nothing: out 0, lse -inf, grads 0.
    q, k, v = (t.requires_grad_() for t in _qkv(1, 1, 1, 12, 5, 4, 4))
    out, lse = ae.scaled_dot_product_attention(q, k, v, is_causal=True, alignment="bottom_right", return_lse=True)
    assert (out[0, 0, :7] == 0).all() and torch.isneginf(lse[0, 0, :7]).all() and torch.isfinite(lse[0, 0, 7:]).all()
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert (dq[0, 0, :7] == 0).all()


@pytest.mark.parametrize("backend", backends())
def test_a_nan_key_outside_every_window_reaches_no_row(backend):
    q, k, v = _qkv(1, 1, 1, 16, 16, 4, 4)
    require(backend, q)
    k[0, 0, 15] = float("nan")
    v[0, 0, 15] = float("inf")
    out = ae.scaled_dot_product_attention(q, k, v, window_size=(3, 0), chunk_size=4, backend=backend)
    assert torch.isfinite(out[0, 0, :15]).all() and torch.isnan(out[0, 0, 15]).all()


def test_triton_takes_the_band_through_the_public_function_and_the_op():
    pytest.importorskip("triton")
    from attn_ext.ops.utils.triton import triton_unavailable_reason

    if triton_unavailable_reason("cpu") is not None:
        pytest.skip(f"Triton interpreter unavailable: {triton_unavailable_reason('cpu')}")
    q, k, v = _qkv(1, 2, 2, 20, 33, 16, 16, dtype=torch.float32)
    ref, _ = dense_attention(q.double(), k.double(), v.double(),
                             attn_mask=band_mask(20, 33, True, (4, 0), "bottom_right"))
    out = ae.scaled_dot_product_attention(q, k, v, is_causal=True, window_size=(4, 0), alignment="bottom_right",
                                          backend="triton")
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    # The op itself takes the band's arguments (window (3, 0) about the top-left diagonal).
    direct, _ = torch.ops.attn_ext.attention_fwd_triton(q, k, v, None, None, 0.25, False, 0.0, None, 16, 3, 0, 0)
    ref3, _ = dense_attention(q.double(), k.double(), v.double(), attn_mask=band_mask(20, 33, False, (3, 0)),
                              scale=0.25)
    torch.testing.assert_close(direct.double(), ref3, rtol=1e-4, atol=1e-5)



@pytest.mark.parametrize("kwargs, error, match", [
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
    (dict(window_size=(1,)), TypeError, "pair"),
    (dict(window_size=(1.5, 0)), TypeError, "ints"),
    (dict(window_size=(True, 0)), TypeError, "ints"),
    (dict(window_size=(3, 2), is_causal=True), ValueError, "is_causal"),
    (dict(alignment="bottom"), ValueError, "alignment"),
    (dict(attn_mask=causal_upper_left(6, 9), alignment="bottom_right"), ValueError, "upper-left"),
])
def test_refused_arguments_are_named(kwargs, error, match):
    q, k, v = _qkv(1, 1, 1, 6, 9, 4, 4)
    with pytest.raises(error, match=match):
        ae.scaled_dot_product_attention(q, k, v, **kwargs)


def test_the_ops_check_their_band_arguments():
    q, k, v = _qkv(1, 1, 1, 6, 9, 4, 4)
    for op in attention_ops():
        with pytest.raises(ValueError, match="window_size"):
            op(q, k, v, None, None, 0.5, False, 0.0, None, 4, -3, 0, 0)


@settings(max_examples=60, deadline=None)
@given(L=st.integers(1, 24), S=st.integers(1, 24), is_causal=st.booleans(), left=st.integers(-1, 10),
       right=st.integers(-1, 10), bottom=st.booleans(), chunk=st.sampled_from([1, 3, 8, 64]))
def test_property_cpp_equals_the_definition(L, S, is_causal, left, right, bottom, chunk):
    if is_causal and right > 0:
        right = 0
    q, k, v = _qkv(1, 2, 1, L, S, 4, 3)
    alignment = "bottom_right" if bottom else "top_left"
    backend = "cpp" if ae.available_backends(q, "scaled_dot_product_attention")["cpp"] is None else "reference"
    out, lse = ae.scaled_dot_product_attention(q, k, v, is_causal=is_causal, window_size=(left, right),
                                               alignment=alignment, enable_gqa=True, chunk_size=chunk,
                                               return_lse=True, backend=backend)
    ref, ref_lse = dense_attention(q, k, v, attn_mask=band_mask(L, S, is_causal, (left, right), alignment))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-12)
