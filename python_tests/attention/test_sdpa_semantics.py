"""``ae.scaled_dot_product_attention`` equals PyTorch's SDPA in fp64 for every argument PyTorch takes,
and the FlashAttention error rule holds in fp32 / fp16 / bf16."""
import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

import attn_ext as ae
from _helpers import assert_within_flash_rule
from _sdpa_ref import backends, dense_attention, require

F64 = torch.float64


def _qkv(B, Hq, Hkv, L, S, D, Dv, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, L, D, generator=g).to(dtype), torch.randn(B, Hkv, S, D, generator=g).to(dtype),
            torch.randn(B, Hkv, S, Dv, generator=g).to(dtype))


def _masks(B, H, L, S, dtype, seed=3):
    g = torch.Generator().manual_seed(seed)
    return {
        "none": None,
        "bool_2d": torch.rand(L, S, generator=g) > 0.3,
        "bool_key_row": torch.rand(B, 1, 1, S, generator=g) > 0.5,
        "bool_full": torch.rand(B, H, L, S, generator=g) > 0.4,
        "float_2d": torch.randn(L, S, generator=g).to(dtype),
        "float_heads": torch.randn(1, H, L, S, generator=g).to(dtype).masked_fill(torch.rand(1, H, L, S, generator=g) < 0.2, -math.inf),
    }


MASKS = ["none", "bool_2d", "bool_key_row", "bool_full", "float_2d", "float_heads"]
SHAPES = [  # B, Hq, Hkv, L, S, D, Dv
    (2, 4, 4, 37, 53, 16, 16),
    (1, 6, 2, 1, 70, 33, 7),  # GQA, one query, odd dims
    (2, 2, 1, 45, 9, 8, 12),  # MQA, L > S
]


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mask", MASKS)
def test_equals_pytorch_sdpa_fp64(backend, shape, mask):
    B, Hq, Hkv, L, S, D, Dv = shape
    q, k, v = _qkv(B, Hq, Hkv, L, S, D, Dv)
    require(backend, q)
    attn_mask = _masks(B, Hq, L, S, F64)[mask]
    gqa = Hq != Hkv
    ours = ae.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=gqa, chunk_size=16, backend=backend)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=gqa)
    # Every row, those without any key too: 0 in both (PyTorch's SDPA since torch 2.5; NaN would fail here).
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("L,S", [(40, 40), (13, 50), (50, 13), (1, 9)])
def test_causal_equals_pytorch(backend, L, S):
    q, k, v = _qkv(2, 4, 2, L, S, 16, 8)
    require(backend, q)
    ours = ae.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, chunk_size=8, backend=backend)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dims", [2, 3, 5])
def test_batch_dims_like_pytorch(backend, dims):
    shape = {2: (), 3: (), 5: (2, 3)}[dims]
    heads = () if dims == 2 else (4,)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(*shape, *heads, 11, 8, generator=g, dtype=F64)
    k = torch.randn(*shape, *heads, 19, 8, generator=g, dtype=F64)
    v = torch.randn(*shape, *heads, 19, 5, generator=g, dtype=F64)
    require(backend, q)
    mask = torch.rand(11, 19, generator=g) > 0.2
    mask[:, 0] = True
    ours, lse = ae.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend, return_lse=True)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert lse.shape == q.shape[:-1]


@pytest.mark.parametrize("backend", backends())
def test_key_padding_with_mask_and_causal(backend):
    q, k, v = _qkv(2, 2, 2, 20, 20, 8, 8)
    require(backend, q)
    padding = torch.zeros(2, 20, dtype=torch.bool)
    padding[0, 12:] = True
    padding[1, :] = True  # every row of batch 1 is empty
    mask = torch.rand(20, 20) > 0.3
    for kw in (dict(attn_mask=mask), dict(is_causal=True)):
        out, lse = ae.scaled_dot_product_attention(q, k, v, key_padding_mask=padding, return_lse=True, backend=backend,
                                                   chunk_size=8, **kw)
        ref, ref_lse = dense_attention(q, k, v, key_padding_mask=padding, attn_mask=kw.get("attn_mask"),
                                       is_causal=kw.get("is_causal", False))
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(lse, ref_lse)
        assert torch.equal(out[1], torch.zeros_like(out[1])) and bool(torch.isneginf(lse[1]).all())


@pytest.mark.parametrize("backend", backends())
def test_strided_inputs_and_mask_views(backend):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 30, 4, 24, generator=g, dtype=F64).transpose(1, 2)[..., :20]  # [B, H, L, D], strided
    k = torch.randn(2, 40, 4, 20, generator=g, dtype=F64).transpose(1, 2)
    v = torch.randn(2, 4, 40, 10, generator=g, dtype=F64)[..., ::2]
    mask = (torch.rand(40, 30, generator=g) > 0.3).t()  # transposed storage
    require(backend, q)
    ours = ae.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend, chunk_size=16)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask", ["bool_2d", "float_heads", "causal"])
def test_flash_rule_low_precision(backend, dtype, mask):
    B, Hq, Hkv, L, S, D, Dv = 2, 4, 2, 33, 77, 40, 24
    q, k, v = _qkv(B, Hq, Hkv, L, S, D, Dv, dtype=dtype, seed=5)
    require(backend, q)
    causal = mask == "causal"
    attn_mask = None if causal else _masks(B, Hq, L, S, dtype)[mask]
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out, lse = ae.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, enable_gqa=True,
                                               return_lse=True, backend=backend, chunk_size=32)
    g = torch.Generator().manual_seed(6)
    grad_out = torch.randn(out.shape, generator=g).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    m64 = None if attn_mask is None else attn_mask.to(F64) if attn_mask.dtype != torch.bool else attn_mask
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = dense_attention(*leaves64, attn_mask=m64, is_causal=causal)
    ref_grads = torch.autograd.grad(ref, leaves64, grad_out.double())
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    same, same_lse = dense_attention(*leaves, attn_mask=attn_mask, is_causal=causal)
    same_grads = torch.autograd.grad(same, leaves, grad_out)
    out, lse = out.detach(), lse.detach()
    assert_within_flash_rule(out, ref.detach(), same.detach(), name=f"out {dtype}")
    assert_within_flash_rule(lse, ref_lse.detach(), same_lse.detach(), name=f"lse {dtype}")
    for name, ours, r, s in zip("qkv", grads, ref_grads, same_grads):
        assert_within_flash_rule(ours, r, s, grad=True, name=f"d{name} {dtype}")


@pytest.mark.parametrize("backend", backends())
def test_empty_problems(backend):
    q, k, v = _qkv(2, 2, 2, 5, 0, 4, 3)
    require(backend, q)
    out, lse = ae.scaled_dot_product_attention(q, k, v, return_lse=True, backend=backend)
    assert torch.equal(out, torch.zeros(2, 2, 5, 3, dtype=F64)) and bool(torch.isneginf(lse).all())
    q0 = q[:, :, :0]
    assert ae.scaled_dot_product_attention(q0, k, v, backend=backend).shape == (2, 2, 0, 3)


@pytest.mark.parametrize("backend", backends())
def test_rows_without_keys_as_pytorch_sdpa_and_where_torch_still_gives_nan(backend):
    """docs/sdpa.md: a row with no key gives 0 and zero gradients, as PyTorch's SDPA does on its default and
    math paths; torch's NaN survives only in nn.MultiheadAttention with need_weights=True and on its
    inference fast path, where ae.nn.MultiheadAttention gives zero attention (out_proj.bias)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = _qkv(2, 2, 2, 5, 6, 4, 3)
    require(backend, q)
    mask = torch.ones(2, 1, 5, 6, dtype=torch.bool)
    mask[0, :, 1] = False  # row 1 of batch entry 0 has no key
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ours = ae.scaled_dot_product_attention(*leaves, attn_mask=mask, backend=backend)
    ours_grads = torch.autograd.grad(ours.sum(), leaves)
    assert torch.equal(ours[0, :, 1], torch.zeros(2, 3, dtype=F64)) and bool((ours_grads[0][0, :, 1] == 0).all())
    for path in (None, SDPBackend.MATH):
        torch_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(path) if path is not None else contextlib.nullcontext():
            theirs = F.scaled_dot_product_attention(*torch_leaves, attn_mask=mask)
            theirs_grads = torch.autograd.grad(theirs.sum(), torch_leaves)
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
        for a, b in zip(ours_grads, theirs_grads):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)

    torch.manual_seed(0)
    reference = torch.nn.MultiheadAttention(4, 2, batch_first=True, dtype=F64)
    module = ae.nn.MultiheadAttention(4, 2, batch_first=True, dtype=F64)
    module.load_state_dict(reference.state_dict())
    for m in (reference, module):
        with torch.no_grad():
            m.out_proj.bias.normal_(generator=torch.Generator().manual_seed(1))
        if hasattr(m, "backend"):
            m.backend = backend
    x = torch.randn(2, 3, 4, dtype=F64)
    padding = torch.tensor([[True] * 3, [False] * 3])  # batch entry 0 has no key
    bias = module.out_proj.bias.expand(3, 4)
    for need_weights in (False, True):  # training mode: torch's NaN only where it forms the weights itself
        expected = reference(x, x, x, key_padding_mask=padding, need_weights=need_weights)[0]
        out = module(x, x, x, key_padding_mask=padding, need_weights=need_weights)[0]
        torch.testing.assert_close(out[0], bias)
        assert bool(torch.isnan(expected[0]).all()) if need_weights else torch.allclose(expected[0], bias)
        torch.testing.assert_close(out[1], expected[1])
    reference.eval()
    module.eval()
    with torch.no_grad():  # torch's inference fast path: NaN whatever need_weights
        for need_weights in (False, True):
            expected = reference(x, x, x, key_padding_mask=padding, need_weights=need_weights)[0]
            assert bool(torch.isnan(expected[0]).all())
            torch.testing.assert_close(module(x, x, x, key_padding_mask=padding, need_weights=need_weights)[0][0], bias)
