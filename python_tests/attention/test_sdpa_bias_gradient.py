"""The gradient of an additive ``attn_mask`` that requires grad (a learned bias) in ``ae.scaled_dot_product_attention``:
the first-order reverse mode takes the chunked rule (op ``attention_bwd_bias`` on the cpp kernels, the reference
kernels' chunked backward elsewhere), which sums the score gradient into the mask's own shape; it must equal the
differentiable composite's gradient (what ``torch.func.vjp`` and higher orders use) for every broadcast shape of the
mask and with the other keywords (window, soft cap, ALiBi, padding, grouped heads, dropout); the FlashAttention rule
in fp32/fp16/bf16; gradcheck and gradgradcheck; forward mode; ``torch.compile``; ``opcheck`` of the op; the op's
gradient keeps the broadcast dims at size 1 (no ``[B, H, L, S]`` buffer for a shared bias).
"""
from __future__ import annotations

import math

import pytest
import torch

import attn_ext as ae
from _helpers import assert_within_flash_rule
from _sdpa_ref import backends, require
from test_sdpa_score_mods import dense, slopes_for

F64 = torch.float64
B, H, L, S, D = 2, 4, 37, 53, 16
SHAPES = [(B, H, L, S), (H, L, S), (L, S), (1, H, 1, S), (B, 1, L, S), (H, L, 1), (S,)]


def _qkv(dtype=F64, seed=0, hkv=H):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, L, D, generator=g).to(dtype), torch.randn(B, hkv, S, D, generator=g).to(dtype),
            torch.randn(B, hkv, S, D, generator=g).to(dtype))


def _bias(shape, dtype=F64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _grads(f, leaves, seed=2):
    out, lse = f(*leaves)
    g = torch.Generator().manual_seed(seed)
    cot = (torch.randn(out.shape, generator=g).to(out.dtype), torch.randn(lse.shape, generator=g).to(lse.dtype))
    return torch.autograd.grad((out, lse), leaves, cot), cot


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_equals_the_composite_for_every_broadcast_shape(backend, shape, monkeypatch):
    from attn_ext.ops.attention import bias_grad

    q, k, v = _qkv()
    require(backend, q)
    leaves = [t.requires_grad_() for t in (q, k, v, _bias(shape))]
    taken = []  # which rule ran: the op attention_bwd_bias (cpp) or the reference kernels' chunks
    for name in ("_in_bias_shape", "BiasGradient"):
        monkeypatch.setattr(bias_grad, name, lambda *a, name=name, f=getattr(bias_grad, name): (taken.append(name),
                                                                                                   f(*a))[1])

    def f(q, k, v, bias):
        return ae.scaled_dot_product_attention(q, k, v, attn_mask=bias, return_lse=True, chunk_size=16,
                                               backend=backend)

    ours, cot = _grads(f, leaves)
    assert taken == ["_in_bias_shape" if backend == "cpp" else "BiasGradient"]
    _, vjp = torch.func.vjp(f, *leaves)  # a torch.func transform: the composite's derivatives
    for a, b, name in zip(ours, vjp(cot), ("dq", "dk", "dv", "dbias")):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_with_window_softcap_alibi_padding_gqa_and_dropout(backend, dropout_p):
    q, k, v = _qkv(hkv=2)
    require(backend, q)
    bias = _bias((H, L, S)).masked_fill(_bias((H, L, S), seed=9) > 1.5, -math.inf)  # some pairs masked by it
    padding = torch.zeros(B, S, dtype=torch.bool)
    padding[1, -7:] = True
    kw = dict(key_padding_mask=padding, window_size=(20, 4), alignment="bottom_right", softcap=2.5,
              alibi_slopes=slopes_for(B, H), enable_gqa=True, dropout_p=dropout_p, return_lse=True, chunk_size=16,
              backend=backend)
    leaves = [t.requires_grad_() for t in (q, k, v, bias)]

    def f(q, k, v, bias):
        torch.manual_seed(7)  # the same dropout keep mask in both calls
        return ae.scaled_dot_product_attention(q, k, v, attn_mask=bias, **kw)

    ours, cot = _grads(f, leaves)
    _, vjp = torch.func.vjp(f, *leaves)
    for a, b, name in zip(ours, vjp(cot), ("dq", "dk", "dv", "dbias")):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
        assert torch.isfinite(a).all()
    assert torch.equal(ours[3][torch.isneginf(bias.detach())], torch.zeros_like(ours[3][torch.isneginf(bias.detach())]))


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_flash_rule(backend, dtype):
    q64, k64, v64 = _qkv()
    bias64 = _bias((H, L, S))
    q, k, v, bias = (t.to(dtype).requires_grad_() for t in (q64, k64, v64, bias64))
    require(backend, q)
    out = ae.scaled_dot_product_attention(q, k, v, attn_mask=bias, softcap=4.0, chunk_size=16, backend=backend)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    same = [t.detach().requires_grad_() for t in (q, k, v, bias)]
    ref, pt = dense(*leaves64[:3], 4.0, None, leaves64[3]), dense(*same[:3], 4.0, None, same[3])
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    for a, r, p, name in zip(torch.autograd.grad(out, (q, k, v, bias), g),
                             torch.autograd.grad(ref, leaves64, g.double()), torch.autograd.grad(pt, same, g),
                             ("dq", "dk", "dv", "dbias")):
        assert a.dtype == dtype
        assert_within_flash_rule(a, r, p, grad=True, name=name)


def test_gradcheck_gradgradcheck_and_forward_mode():
    q, k, v = (t[:1, :2, :6, :4].contiguous().requires_grad_() for t in _qkv())
    bias = _bias((2, 6, 6)).requires_grad_()
    for backend in backends():
        if ae.available_backends(q, "scaled_dot_product_attention")[backend] is not None:
            continue

        def f(q, k, v, bias, backend=backend):
            return ae.scaled_dot_product_attention(q, k, v, attn_mask=bias, window_size=(3, 1), softcap=1.5,
                                                   return_lse=True, chunk_size=4, backend=backend)

        assert torch.autograd.gradcheck(f, (q, k, v, bias))
        assert torch.autograd.gradgradcheck(f, (q, k, v, bias))
        tangents = tuple(torch.randn_like(t) for t in (q, k, v, bias))
        primals = tuple(t.detach() for t in (q, k, v, bias))
        _, jvp = torch.func.jvp(lambda *a: f(*a)[0], primals, tangents)
        ref = torch.func.jvp(lambda q, k, v, b: dense(q, k, v, 1.5, None, b.masked_fill(
            ~_band(6, 6, 3, 1), -math.inf)), primals, tangents)[1]
        torch.testing.assert_close(jvp, ref, rtol=1e-9, atol=1e-11)
        with torch.autograd.forward_ad.dual_level():  # forward mode through the public function
            dual = torch.autograd.forward_ad.make_dual(primals[3], tangents[3])
            out = f(*primals[:3], dual)[0]
            tangent = torch.autograd.forward_ad.unpack_dual(out).tangent
        ref_b = torch.func.jvp(lambda b: f(*primals[:3], b)[0], (primals[3],), (tangents[3],))[1]
        torch.testing.assert_close(tangent, ref_b, rtol=1e-9, atol=1e-11)


def _band(lq, lk, left, right):
    i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
    return (j >= i - left) & (j <= i + right)


def test_torch_compile_gives_the_same_gradients():
    q, k, v = (t.float().requires_grad_() for t in _qkv())
    bias = _bias((H, L, S), torch.float32).requires_grad_()

    def f(q, k, v, bias):
        return ae.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    compiled = torch.autograd.grad(torch.compile(f)(q, k, v, bias).sum(), (q, bias))
    eager = torch.autograd.grad(f(q, k, v, bias).sum(), (q, bias))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not hasattr(torch.ops.attn_ext, "attention_bwd_bias"), reason="the extension is not built")
def test_the_op_keeps_broadcast_dims_at_size_one_and_passes_opcheck():
    q, k, v = (t.float() for t in _qkv())
    out, lse = ae.scaled_dot_product_attention(q, k, v, return_lse=True)
    for shape, expect in (((H, L, S), (1, H, L, S)), ((L, S), (1, 1, L, S)), ((B, H, L, S), (B, H, L, S)),
                          ((H, L, 1), (1, H, L, 1))):
        mask = _bias(shape, torch.float32).expand(B, H, L, S)
        args = (torch.ones_like(out), torch.zeros_like(lse), q, k, v, mask, None, out, lse, 0.25, False, 0.0, None, 16)
        grads = torch.ops.attn_ext.attention_bwd_bias(*args)
        assert tuple(grads[3].shape) == expect and grads[3].dtype == torch.float32
        torch.library.opcheck(torch.ops.attn_ext.attention_bwd_bias, args)
    with pytest.raises(TypeError, match="additive"):
        torch.ops.attn_ext.attention_bwd_bias(torch.ones_like(out), torch.zeros_like(lse), q, k, v,
                                              torch.ones(B, H, L, S, dtype=torch.bool), None, out, lse, 0.25, False,
                                              0.0, None, 16)


def test_the_reference_path_sums_narrow_key_chunks(monkeypatch):
    """Off the cpp kernels (reference, Triton, CUDA) the backward visits key chunks narrower than S when the
    [B, H, L, c] tiles would be large, and sums each into the bias's shape: the same gradient."""
    from attn_ext.ops.attention import bias_grad

    q, k, v = _qkv()
    bias = _bias((H, L, S)).requires_grad_()
    widths = []
    original = bias_grad.BiasGradient.add

    def recording(self, grad_scores, n0, n1):
        widths.append(n1 - n0)
        assert tuple(self.grad.shape) == (H, L, S)
        return original(self, grad_scores, n0, n1)

    monkeypatch.setattr(bias_grad.BiasGradient, "add", recording)
    monkeypatch.setattr(bias_grad, "CHUNK_ELEMENTS", B * H * L * 16)
    out = ae.scaled_dot_product_attention(q, k, v, attn_mask=bias, backend="reference")
    (ours,) = torch.autograd.grad(out.sum(), bias)
    assert widths and max(widths) == 16 and sum(widths) == S
    (theirs,) = torch.autograd.grad(dense(q, k, v, None, None, bias).sum(), bias)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


def test_triton_forward_with_the_chunked_backward():
    from attn_ext.ops.utils.triton import triton_unavailable_reason

    if triton_unavailable_reason("cpu") is not None:
        pytest.skip(f"Triton interpreter unavailable: {triton_unavailable_reason('cpu')}")
    q, k, v = (t.float().requires_grad_() for t in _qkv())
    bias = _bias((1, H, L, S), torch.float32).requires_grad_()
    out = ae.scaled_dot_product_attention(q, k, v, attn_mask=bias, window_size=(16, 16), chunk_size=16,
                                          backend="triton")
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    same = [t.detach().requires_grad_() for t in (q, k, v, bias)]
    band = _band(L, S, 16, 16)
    ref = dense(*leaves64[:3], None, None, leaves64[3].masked_fill(~band, -math.inf))
    pt = dense(*same[:3], None, None, same[3].masked_fill(~band, -math.inf))
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    for a, r, p, name in zip(torch.autograd.grad(out, (q, k, v, bias), g),
                             torch.autograd.grad(ref, leaves64, g.double()), torch.autograd.grad(pt, same, g),
                             ("dq", "dk", "dv", "dbias")):
        assert_within_flash_rule(a, r, p, grad=True, name=name)


def test_the_ops_gradient_becomes_the_bias_gradient_without_a_copy():
    """A bias [H, L, S] gets the op's [1, H, L, S] gradient as a view (a copy would double the gradient's memory)."""
    from attn_ext.ops.attention.bias_grad import _in_bias_shape

    g = torch.randn(1, H, L, S)
    for bias_shape, lead in (((H, L, S), (B, H, L)), ((L, S), (B, H, L)), ((H, L, S), (H, L))):
        grad = _in_bias_shape(g if len(bias_shape) == 3 else g[:, :1], torch.empty(bias_shape), lead)
        assert tuple(grad.shape) == bias_shape and grad.data_ptr() == g.data_ptr()
    summed = _in_bias_shape(torch.ones(B, H, L, S), torch.empty(H, L, S), (B, H, L))  # a batch dim to sum
    assert torch.equal(summed, torch.full((H, L, S), float(B)))
