"""The soft cap and ALiBi of ``ae.scaled_dot_product_attention`` (``softcap``, ``alibi_slopes``): every backend that
has them against the dense fp64 composition written from the definition (``c·tanh(scale·q·k / c)``, then the float
mask and ``−slope·|i' − j|``), combined with the band, masks, padding, grouped heads and dropout; the FlashAttention
rule in fp32/fp16/bf16; derivatives of every order; opcheck; the backends without them say so; bad arguments are
named."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attn_ext as ae
from _helpers import assert_within_flash_rule
from _sdpa_ref import attention_ops, backends, require
from test_sdpa_window import band_mask

F64 = torch.float64


def dense(q, k, v, softcap=None, slopes=None, attn_mask=None, alignment="top_left", scale=None):
    """Scores from the definition, then softmax (rows without a key: 0); GQA by repeating heads; differentiable."""
    B, H, L, D = q.shape
    S = k.shape[2]
    group = H // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.matmul(q, k.transpose(-1, -2)) * (D ** -0.5 if scale is None else scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    allowed = torch.ones(L, S, dtype=torch.bool, device=q.device)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            s = s + torch.where(torch.isneginf(attn_mask), torch.zeros_like(attn_mask), attn_mask)
            allowed = allowed & ~torch.isneginf(attn_mask)
    if slopes is not None:
        diag = S - L if alignment == "bottom_right" else 0
        dist = (torch.arange(L, device=q.device)[:, None] + diag - torch.arange(S, device=q.device)[None, :]).abs().to(
            s.dtype)
        s = s - slopes.to(s).reshape(-1, H)[:, :, None, None] * dist
    s = torch.where(allowed, s, torch.full_like(s, -math.inf))
    empty = ~allowed.expand(s.shape).any(-1, keepdim=True)
    p = torch.where(empty, torch.zeros_like(s), torch.softmax(torch.where(empty, torch.zeros_like(s), s), -1))
    return torch.matmul(p, v)


def _qkv(B, Hq, Hkv, L, S, D, Dv, dtype=F64, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    return (spread * torch.randn(B, Hq, L, D, generator=g).to(dtype), torch.randn(B, Hkv, S, D, generator=g).to(dtype),
            torch.randn(B, Hkv, S, Dv, generator=g).to(dtype))


def slopes_for(B, H, per_batch=False):
    base = torch.tensor([2.0 ** (-8 * (h + 1) / H) for h in range(H)], dtype=torch.float32)
    return base.expand(B, H) * torch.arange(1, B + 1, dtype=torch.float32)[:, None] if per_batch else base


CASES = [  # softcap, alibi (None | "heads" | "batch"), is_causal, window, alignment
    (3.0, None, False, None, "top_left"),
    (None, "heads", False, None, "top_left"),
    (None, "batch", True, None, "bottom_right"),
    (1.5, "heads", True, (6, 0), "bottom_right"),
    (8.0, "batch", False, (4, 4), "top_left"),
]


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("shape", [(2, 4, 2, 19, 40, 8, 8), (2, 2, 2, 33, 12, 16, 4)], ids=str)
def test_equals_the_definition_fp64(backend, case, shape):
    softcap, alibi, is_causal, window, alignment = case
    B, Hq, Hkv, L, S, D, Dv = shape
    q, k, v = (t.requires_grad_() for t in _qkv(B, Hq, Hkv, L, S, D, Dv, spread=3.0))
    require(backend, q)
    slopes = None if alibi is None else slopes_for(B, Hq, alibi == "batch")
    out = ae.scaled_dot_product_attention(q, k, v, softcap=softcap, alibi_slopes=slopes, is_causal=is_causal,
                                          window_size=window, alignment=alignment, enable_gqa=Hq != Hkv, chunk_size=8,
                                          backend=backend)
    ref = dense(q, k, v, softcap, slopes, band_mask(L, S, is_causal, window, alignment), alignment)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    g = torch.randn_like(out)
    for a, b, name in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g), "qkv"):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("backend", backends())
def test_with_a_float_mask_padding_and_dropout(backend):
    B, Hq, Hkv, L, S, D, Dv = 2, 4, 2, 21, 30, 8, 8
    q, k, v = _qkv(B, Hq, Hkv, L, S, D, Dv)
    require(backend, q)
    g = torch.Generator().manual_seed(3)
    mask = torch.randn(1, Hq, L, S, generator=g, dtype=F64).masked_fill(torch.rand(1, Hq, L, S, generator=g) < 0.1,
                                                                       -math.inf)
    padding = torch.zeros(B, S, dtype=torch.bool)
    padding[0, -5:] = True
    slopes = slopes_for(B, Hq)
    out = ae.scaled_dot_product_attention(q, k, v, attn_mask=mask, key_padding_mask=padding, softcap=2.0,
                                          alibi_slopes=slopes, enable_gqa=True, chunk_size=8, backend=backend)
    full = mask.masked_fill(padding[:, None, None, :], -math.inf)
    ref = dense(q, k, v, 2.0, slopes, full)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    # Dropout: the same keep mask as without the score modifications, on both backends.
    torch.manual_seed(5)
    ours = ae.scaled_dot_product_attention(q, k, v, softcap=2.0, alibi_slopes=slopes, dropout_p=0.25,
                                           enable_gqa=True, chunk_size=8, backend=backend)
    torch.manual_seed(5)
    theirs = ae.scaled_dot_product_attention(q, k, v, softcap=2.0, alibi_slopes=slopes, dropout_p=0.25,
                                             enable_gqa=True, chunk_size=16, backend="reference")
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_flash_rule(backend, dtype):
    B, Hq, Hkv, L, S, D, Dv = 2, 4, 4, 48, 64, 32, 32
    q64, k64, v64 = _qkv(B, Hq, Hkv, L, S, D, Dv, spread=4.0)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q64, k64, v64))
    require(backend, q)
    slopes = slopes_for(B, Hq)
    out = ae.scaled_dot_product_attention(q, k, v, softcap=5.0, alibi_slopes=slopes, is_causal=True, chunk_size=16,
                                          backend=backend)
    mask = band_mask(L, S, True)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = dense(*leaves64, 5.0, slopes, mask)
    same = [t.detach().requires_grad_() for t in (q, k, v)]
    pt = dense(*same, 5.0, slopes, mask)
    assert_within_flash_rule(out.detach(), ref.detach(), pt.detach(), name="out")
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    for a, r, p, name in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, leaves64, g.double()),
                             torch.autograd.grad(pt, same, g), "qkv"):
        assert_within_flash_rule(a, r, p, grad=True, name=f"d{name}")


@pytest.mark.parametrize("backend", backends())
def test_gradcheck_gradgradcheck_and_forward_mode(backend):
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 1, 6, 9, 4, 3, spread=2.0))
    require(backend, q)
    slopes = slopes_for(1, 2)

    def f(q, k, v):
        return ae.scaled_dot_product_attention(q, k, v, softcap=1.5, alibi_slopes=slopes, window_size=(3, 1),
                                               enable_gqa=True, chunk_size=4, return_lse=True, backend=backend)

    assert torch.autograd.gradcheck(f, (q, k, v))
    assert torch.autograd.gradgradcheck(f, (q, k, v))
    tangents = tuple(torch.randn_like(t) for t in (q, k, v))
    primals = tuple(t.detach() for t in (q, k, v))
    _, jvp = torch.func.jvp(lambda *a: f(*a)[0], primals, tangents)
    ref = torch.func.jvp(lambda q, k, v: dense(q, k, v, 1.5, slopes, band_mask(6, 9, False, (3, 1))), primals,
                         tangents)[1]
    torch.testing.assert_close(jvp, ref, rtol=1e-9, atol=1e-11)


def test_opcheck():
    q, k, v = _qkv(2, 2, 2, 9, 13, 8, 8, dtype=torch.float32)
    slopes = slopes_for(2, 2, per_batch=True)
    for op in attention_ops():
        torch.library.opcheck(op, (q, k, v, None, None, 0.3, True, 0.0, None, 4, -1, -1, 4, 2.5, slopes))
        torch.library.opcheck(op, (q, k, v, None, None, 0.3, False, 0.0, None, 4, 2, 5, 0, 0.0, slopes))


def test_every_backend_takes_them_and_auto_keeps_its_choice():
    """No backend refuses a soft cap or ALiBi any more (the CUDA kernels have them too, tested on their source in
    the host emulation and on a GPU in python_tests/gpu/test_gpu_band_scores.py): the automatic choice is the one
    it makes without them, and a CUDA tensor's call would reach the CUDA kernels' op, which takes the arguments."""
    q, k, v = _qkv(1, 2, 2, 5, 7, 4, 4, dtype=torch.float32)
    from attn_ext.ops.attention import registration

    assert registration._cuda_supports_call(q, {"dropout_p": 0.0}) is None
    assert "dropout" in registration._cuda_supports_call(q, {"dropout_p": 0.1})
    out = ae.scaled_dot_product_attention(q, k, v, softcap=2.0, alibi_slopes=torch.tensor([0.5, 0.25]))
    ref = dense(q.double(), k.double(), v.double(), 2.0, torch.tensor([0.5, 0.25]), None, "top_left")
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)



@pytest.mark.parametrize("kwargs, error, match", [
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(alibi_slopes=[0.5, 0.25]), TypeError, "alibi_slopes"),
    (dict(alibi_slopes=torch.ones(2, dtype=F64)), TypeError, "float32"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, r"\(Hq,\)"),
    (dict(alibi_slopes=torch.ones(5, 2)), ValueError, r"\(Hq,\)"),
    (dict(alibi_slopes=torch.tensor([0.5, float("nan")])), ValueError, "finite"),
])
def test_refused_arguments_are_named(kwargs, error, match):
    q, k, v = _qkv(1, 2, 2, 5, 7, 4, 4)
    with pytest.raises(error, match=match):
        ae.scaled_dot_product_attention(q, k, v, **kwargs)


def test_the_ops_check_their_arguments():
    q, k, v = _qkv(1, 2, 2, 5, 7, 4, 4)
    for op in attention_ops():
        with pytest.raises(ValueError, match="softcap"):
            op(q, k, v, None, None, 0.5, False, 0.0, None, 4, -1, -1, 0, -2.0, None)
        with pytest.raises(ValueError, match=r"\[B, Hq\]"):
            op(q, k, v, None, None, 0.5, False, 0.0, None, 4, -1, -1, 0, 0.0, torch.ones(2))


@settings(max_examples=40, deadline=None)
@given(L=st.integers(1, 16), S=st.integers(1, 16), softcap=st.sampled_from([None, 0.5, 3.0]),
       alibi=st.booleans(), bottom=st.booleans(), chunk=st.sampled_from([1, 4, 64]))
def test_property_cpp_equals_the_definition(L, S, softcap, alibi, bottom, chunk):
    q, k, v = _qkv(1, 2, 2, L, S, 4, 3, spread=3.0)
    backend = "cpp" if ae.available_backends(q, "scaled_dot_product_attention")["cpp"] is None else "reference"
    alignment = "bottom_right" if bottom else "top_left"
    slopes = slopes_for(1, 2) if alibi else None
    out = ae.scaled_dot_product_attention(q, k, v, softcap=softcap, alibi_slopes=slopes, alignment=alignment,
                                          chunk_size=chunk, backend=backend)
    torch.testing.assert_close(out, dense(q, k, v, softcap, slopes, None, alignment), rtol=1e-10, atol=1e-12)
