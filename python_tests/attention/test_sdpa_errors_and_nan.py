"""Bad arguments raise naming the shapes or the reason; masked pairs are never read (NaN rule); a
hypothesis property against PyTorch's SDPA in fp64 over random shapes, masks and heads."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import attn_ext as ae
from _sdpa_ref import backends, require

F64 = torch.float64
sdpa = ae.scaled_dot_product_attention


def _qkv(Hkv=2, L=6, S=9):
    return torch.randn(2, 4, L, 8), torch.randn(2, Hkv, S, 8), torch.randn(2, Hkv, S, 5)


@pytest.mark.parametrize("call,error,match", [
    (lambda q, k, v: sdpa(q, k, v, attn_mask=torch.ones(6, 9, dtype=torch.bool), is_causal=True), ValueError,
     "cannot be combined with is_causal"),
    (lambda q, k, v: sdpa(q, k, v, attn_mask=torch.ones(6, 8, dtype=torch.bool)), ValueError, r"\(6, 8\) does not broadcast"),
    (lambda q, k, v: sdpa(q, k, v, attn_mask=torch.ones(3, 4, 6, 9, dtype=torch.bool)), ValueError, "does not broadcast"),
    (lambda q, k, v: sdpa(q, k, v, attn_mask=torch.ones(6, 9, dtype=torch.int32)), TypeError, "must be bool"),
    (lambda q, k, v: sdpa(q, k, v, attn_mask=torch.ones(6, 9, dtype=F64)), TypeError, "must be bool"),
    (lambda q, k, v: sdpa(q, k, v, dropout_p=1.0), ValueError, r"dropout_p must be a float in \[0, 1\)"),
    (lambda q, k, v: sdpa(q, k, v, dropout_p=-0.1), ValueError, "dropout_p"),
    (lambda q, k, v: sdpa(q, k[:, :1], v[:, :1]), ValueError, "set enable_gqa=True"),
    (lambda q, k, v: sdpa(q, k[:, :3].repeat(1, 1, 1, 1), v[:, :3], enable_gqa=True), ValueError, "multiple"),
    (lambda q, k, v: sdpa(q, k[..., :7], v), ValueError, "same positive embedding dim"),
    (lambda q, k, v: sdpa(q, k, v[:, :, :8]), ValueError, "agree in every dim"),
    (lambda q, k, v: sdpa(q[:1], k, v), ValueError, "batch dims"),
    (lambda q, k, v: sdpa(q, k.double(), v), TypeError, "share a dtype"),
    (lambda q, k, v: sdpa(q, k, v, key_padding_mask=torch.zeros(2, 8, dtype=torch.bool)), ValueError, r"\(2, 9\)"),
    (lambda q, k, v: sdpa(q, k, v, key_padding_mask=torch.zeros(2, 9)), TypeError, "bool"),
    (lambda q, k, v: sdpa(q, k, v, scale=float("nan")), ValueError, "scale"),
    (lambda q, k, v: sdpa(q, k, v, is_causal=1), TypeError, "is_causal"),
    (lambda q, k, v: sdpa(q, k, v, backend="cuda"), RuntimeError, "cuda"),
])
def test_bad_arguments(call, error, match):
    q, k, v = _qkv(Hkv=4)
    with pytest.raises(error, match=match):
        call(q, k, v)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("poison", [math.nan, math.inf])
@pytest.mark.parametrize("reader", [False, True])
def test_masked_pairs_are_never_read(backend, poison, reader):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g, dtype=F64), torch.randn(1, 2, 12, 4, generator=g, dtype=F64),
               torch.randn(1, 2, 12, 3, generator=g, dtype=F64))
    require(backend, q)
    # Key 11 is masked for every query (reader=False) or for all but the last (reader=True); poison it.
    mask = torch.ones(8, 12, dtype=torch.bool)
    mask[: 7 if reader else 8, 11] = False
    k[..., 11, 0] = poison
    v[..., 11, 1] = poison
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = sdpa(*leaves, attn_mask=mask, backend=backend, chunk_size=5)
    clean = [t.detach().clone() for t in (q, k, v)]
    clean[1][..., 11, :] = 0
    clean[2][..., 11, :] = 0
    expected = F.scaled_dot_product_attention(*clean, attn_mask=mask)
    torch.testing.assert_close(out[..., :7, :], expected[..., :7, :])
    if reader:  # the one row that reads key 11 is NaN, by IEEE softmax
        assert bool(torch.isnan(out[..., 7, :]).any())
        return
    torch.testing.assert_close(out, expected)
    grad_q, grad_k, grad_v = torch.autograd.grad(out.sum(), leaves)
    assert bool(torch.isfinite(grad_q).all() and torch.isfinite(grad_k).all() and torch.isfinite(grad_v).all())
    assert bool((grad_k[..., 11, :] == 0).all() and (grad_v[..., 11, :] == 0).all())


@pytest.mark.parametrize("backend", backends())
def test_nan_query_row_does_not_reach_keys_it_does_not_attend(backend):
    q, k, v = (torch.randn(1, 1, 4, 4, dtype=F64), torch.randn(1, 1, 4, 4, dtype=F64), torch.randn(1, 1, 4, 2, dtype=F64))
    require(backend, q)
    q[..., 0, :] = math.nan  # causal: query 0 reads key 0 only
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = sdpa(*leaves, is_causal=True, backend=backend)
    _, grad_k, grad_v = torch.autograd.grad(out[..., 1:, :].sum(), leaves)
    assert bool(torch.isfinite(grad_k[..., 1:, :]).all() and torch.isfinite(grad_v[..., 1:, :]).all())


@st.composite
def _problems(draw):
    Hkv = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))
    return dict(B=draw(st.integers(1, 2)), Hkv=Hkv, Hq=Hkv * group, L=draw(st.integers(1, 20)), S=draw(st.integers(1, 20)),
                D=draw(st.integers(1, 12)), Dv=draw(st.integers(1, 9)), chunk=draw(st.integers(1, 24)),
                mask=draw(st.sampled_from(["none", "bool", "float", "causal", "row"])), seed=draw(st.integers(0, 99)))


@given(_problems())
def test_property_equals_pytorch(p):
    g = torch.Generator().manual_seed(p["seed"])
    B, Hq, Hkv, L, S = p["B"], p["Hq"], p["Hkv"], p["L"], p["S"]
    q = torch.randn(B, Hq, L, p["D"], generator=g, dtype=F64)
    k = torch.randn(B, Hkv, S, p["D"], generator=g, dtype=F64)
    v = torch.randn(B, Hkv, S, p["Dv"], generator=g, dtype=F64)
    mask = {"none": None, "causal": None, "bool": torch.rand(B, 1, L, S, generator=g) > 0.3,
            "float": torch.randn(Hq, L, S, generator=g, dtype=F64), "row": torch.rand(1, S, generator=g) > 0.5}[p["mask"]]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=p["mask"] == "causal",
                                              enable_gqa=Hq != Hkv)
    for backend in backends():
        if ae.available_backends(q, "scaled_dot_product_attention")[backend] is not None:
            continue
        out = sdpa(q, k, v, attn_mask=mask, is_causal=p["mask"] == "causal", enable_gqa=Hq != Hkv,
                   chunk_size=p["chunk"], backend=backend)
        # Rows without any key give 0 in both (PyTorch's SDPA since torch 2.5).
        torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-11)
