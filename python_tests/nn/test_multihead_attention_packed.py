"""``MultiheadAttention.packed``: a batch of sequences of different lengths laid end to end gives, row for row,
what ``forward`` gives each sequence alone (fp64 exact up to rounding; fp32 within the flash rule of the padded
torch module), with gradients; the refused arguments and shapes raise errors naming them."""
from __future__ import annotations

import pytest
import torch

import attn_ext as ae
from _helpers import assert_within_flash_rule

LENS_Q, LENS_K = (3, 7, 1, 0, 5), (5, 2, 9, 4, 0)  # an empty query set and an empty key set among them


def _offsets(lens):
    return torch.tensor([0, *lens]).cumsum(0).to(torch.int32)


def _module(dtype=torch.float64, **kwargs):
    torch.manual_seed(0)
    return ae.nn.MultiheadAttention(24, 4, batch_first=True, dtype=dtype, **kwargs)


def _one_by_one(mha, query, key, value, is_causal=False, alignment="top_left"):
    """Each sequence through ``forward`` alone (a causal mask of its own for ``is_causal``)."""
    cq, ck = _offsets(LENS_Q), _offsets(LENS_K)
    outs = []
    for b, (lq, lk) in enumerate(zip(LENS_Q, LENS_K)):
        q, k, v = query[cq[b]:cq[b + 1]][None], key[ck[b]:ck[b + 1]][None], value[ck[b]:ck[b + 1]][None]
        if lq == 0:
            outs.append(query.new_zeros(0, mha.embed_dim))
            continue
        if lk == 0:  # no key: the attention vector is zero, the output out_proj's bias
            outs.append(mha.out_proj(query.new_zeros(lq, mha.embed_dim)))
            continue
        mask = None
        if is_causal:
            shift = lk - lq if alignment == "bottom_right" else 0
            mask = torch.ones(lq, lk, dtype=torch.bool).tril(shift).logical_not()
        if mask is not None and bool(mask.all(-1).any()):  # a row with no key: zero vector as above
            out = mha(q, k, v, attn_mask=mask.float().masked_fill(mask, float("-inf")).to(q.dtype),
                      need_weights=False)[0][0]
            empty = mask.all(-1)
            out[empty] = mha.out_proj(query.new_zeros(int(empty.sum()), mha.embed_dim))
            outs.append(out)
            continue
        outs.append(mha(q, k, v, attn_mask=mask, need_weights=False)[0][0])
    return torch.cat(outs)


@pytest.mark.parametrize("is_causal,alignment", [(False, "top_left"), (True, "top_left"), (True, "bottom_right")])
def test_packed_equals_each_sequence_alone_in_fp64(is_causal, alignment):
    mha = _module()
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(sum(LENS_Q), 24, generator=gen, dtype=torch.float64, requires_grad=True)
    key = torch.randn(sum(LENS_K), 24, generator=gen, dtype=torch.float64, requires_grad=True)
    value = torch.randn(sum(LENS_K), 24, generator=gen, dtype=torch.float64, requires_grad=True)
    out = mha.packed(query, key, value, _offsets(LENS_Q), _offsets(LENS_K), is_causal=is_causal, alignment=alignment)
    expected = _one_by_one(mha, query, key, value, is_causal, alignment)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (query, key, value, mha.in_proj_weight), grad)
    want = torch.autograd.grad(expected, (query, key, value, mha.in_proj_weight), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@torch.no_grad()
def test_packed_fp32_within_the_flash_rule_of_the_padded_module():
    mha64, mha32 = _module(), _module(torch.float32)
    gen = torch.Generator().manual_seed(2)
    query, key = (torch.randn(sum(n), 24, generator=gen, dtype=torch.float64) for n in (LENS_Q, LENS_K))
    exact = mha64.packed(query, key, key, _offsets(LENS_Q), _offsets(LENS_K))
    ours = mha32.packed(query.float(), key.float(), key.float(), _offsets(LENS_Q), _offsets(LENS_K))
    theirs = _one_by_one(mha32, query.float(), key.float(), key.float())
    assert_within_flash_rule(ours, theirs, exact)


def test_cross_attention_module_and_kdim_vdim():
    torch.manual_seed(0)
    mha = ae.nn.MultiheadAttention(24, 4, kdim=10, vdim=6, batch_first=True, dtype=torch.float64)
    query = torch.randn(sum(LENS_Q), 24, dtype=torch.float64)
    key, value = torch.randn(sum(LENS_K), 10, dtype=torch.float64), torch.randn(sum(LENS_K), 6, dtype=torch.float64)
    out = mha.packed(query, key, value, _offsets(LENS_Q), _offsets(LENS_K))
    torch.testing.assert_close(out, _one_by_one(mha, query, key, value), rtol=1e-12, atol=1e-12)
    assert ae.nn.MultiheadCrossAttention(24, 4).packed(query.float(), query.float(), query.float(),
                                                       _offsets(LENS_Q), _offsets(LENS_Q)).shape == (16, 24)


def test_refusals_name_the_argument():
    q = torch.randn(16, 24)
    cu = _offsets(LENS_Q)
    with pytest.raises(NotImplementedError, match="add_bias_kv and add_zero_attn"):
        ae.nn.MultiheadAttention(24, 4, add_bias_kv=True).packed(q, q, q, cu, cu)
    mha = ae.nn.MultiheadAttention(24, 4)
    with pytest.raises(ValueError, match=r"query must be \[total, 24\]"):
        mha.packed(q[None], q, q, cu, cu)
    with pytest.raises(ValueError, match="same number of rows"):
        mha.packed(q, q, q[:-1], cu, cu)
    with pytest.raises(ValueError, match="cu_seqlens"):
        mha.packed(q, q, q, cu[:-1], cu)
