"""Sizes of 0 in every dimension of the attention ops and their states, forward and backward, on every
backend (the harness: _zero_sizes.py; Intention, trees and the solvers: test_zero_sizes_intention.py).

Each dimension set to 0 gives PyTorch's answer of the same math — empty results where a result has
that dimension, ``0`` and ``lse = −inf`` for a query with no key (as ``torch.nn.functional.
scaled_dot_product_attention``'s ``0``), the lse of the scores for ``Dv = 0`` — with matching
gradients; a zero head dim ``D`` (whose default scale ``1/√D`` is infinite) is refused naming the op.
Before this test, zero heads killed the process (SIGFPE) in the C++ backward and SDPA refused ``H = 0``.
"""
from __future__ import annotations

import math

import pytest
import torch

import attn_ext as ae
from _zero_sizes import (F64, REFUSE_D, Case, attention, check, key_allowed, padding, params, randn)

ATTENTION_BACKENDS = ("cpp", "reference", "triton")
SIZES = dict(B=2, H=2, M=3, N=5, D=4, Dv=3)


def _qkv(s, dtype, g):
    H = s["H"]
    Hkv = s.get("Hkv", H)
    return (randn(g, dtype, s["B"], H, s["M"], s["D"]), randn(g, dtype, s["B"], Hkv, s["N"], s["D"]),
            randn(g, dtype, s["B"], Hkv, s["N"], s["Dv"]))


def _qkv_mask(s, dtype, g):
    return _qkv(s, dtype, g) + (padding(g, s["B"], s["N"]),)


def _causal(M, N):
    return torch.ones(M, N, dtype=torch.bool).tril()


def _keep(q, S, p):
    """The keep mask of the SDPA call that draws its seed right after ``torch.manual_seed(1)``."""
    from attn_ext.ops.attention.dropout import keep_mask

    seed = torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64)
    return keep_mask(int(seed), p, (q.shape[0], q.shape[1], q.shape[2], S))


def _merge(oa, la, ob, lb):
    lse = torch.logaddexp(la, lb)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    wa = torch.where(torch.isneginf(la), torch.zeros_like(la), torch.exp(la - safe))
    wb = torch.where(torch.isneginf(lb), torch.zeros_like(lb), torch.exp(lb - safe))
    return wa[..., None] * oa + wb[..., None] * ob, lse


def _states(s, dtype, g):
    B, H, M, Dv = s["B"], s["H"], s["M"], s["Dv"]
    acc = F64 if dtype == F64 else torch.float32
    return (randn(g, dtype, B, H, M, Dv), randn(g, acc, B, H, M), randn(g, dtype, B, H, M, Dv), randn(g, acc, B, H, M))


GQA_SIZES = dict(B=2, Hq=4, Hkv=2, L=3, S=5, E=4, Ev=3)


def _gqa(s, dtype, g):
    return (randn(g, dtype, s["B"], s["Hq"], s["L"], s["E"]), randn(g, dtype, s["B"], s["Hkv"], s["S"], s["E"]),
            randn(g, dtype, s["B"], s["Hkv"], s["S"], s["Ev"]))


BATCH_SIZES = dict(B1=2, B2=2, H=1, L=3, S=4, E=4, Ev=2)


def _batch_dims(s, dtype, g):
    lead = (s["B1"], s["B2"], s["H"])
    return (randn(g, dtype, *lead, s["L"], s["E"]), randn(g, dtype, *lead, s["S"], s["E"]),
            randn(g, dtype, *lead, s["S"], s["Ev"]))


def _flat(x):
    return x.reshape((math.prod(x.shape[:-3]),) + tuple(x.shape[-3:]))


def _packed(s, dtype, g):
    """A packed batch of B sequences of M queries and N keys each: q [B·M, H, D], k, v [B·N, H, ·], cu_seqlens."""
    B, H, M, N = s["B"], s["H"], s["M"], s["N"]
    cu = lambda n: torch.arange(B + 1, dtype=torch.int32) * n  # noqa: E731
    return (randn(g, dtype, B * M, H, s["D"]), randn(g, dtype, B * N, H, s["D"]), randn(g, dtype, B * N, H, s["Dv"]),
            cu(M), cu(N))


def _packed_reference(q, k, v, cu_q, cu_k):
    """Each sequence's attention (every sequence has the same lengths here), in the packed layout."""
    B = cu_q.numel() - 1
    M, N = (int(cu[1]) if B else 0 for cu in (cu_q, cu_k))
    unpack = lambda t, n: t.reshape(B, n, *t.shape[1:]).transpose(1, 2)  # noqa: E731
    out, lse = attention(unpack(q, M), unpack(k, N), unpack(v, N))
    H = q.shape[1]
    return out.transpose(1, 2).reshape(B * M, H, out.shape[-1]), lse.permute(1, 0, 2).reshape(H, B * M)


def _paged(s, dtype, g):
    """A paged cache of B entries of N keys each in blocks of 2 (entry b's blocks b·nb .. (b + 1)·nb − 1)."""
    B, H, N = s["B"], s["H"], s["N"]
    per_entry = (N + 1) // 2
    table = torch.arange(B * per_entry, dtype=torch.int32).reshape(B, per_entry)
    return (randn(g, dtype, B, H, s["M"], s["D"]), randn(g, dtype, B * per_entry, 2, H, s["D"]),
            randn(g, dtype, B * per_entry, 2, H, s["Dv"]), table, torch.full((B,), N, dtype=torch.int32))


def _paged_reference(q, k_cache, v_cache, table, seqlens):
    B, N = q.shape[0], int(seqlens[0]) if seqlens.numel() else 0
    rows = lambda c: c.reshape(B, table.shape[1] * 2, *c.shape[2:])[:, :N].transpose(1, 2)  # noqa: E731
    return attention(q, rows(k_cache), rows(v_cache))


CASES = [
    Case("paged_attention", SIZES, _paged,
         lambda b, q, kc, vc, t, n: ae.paged_attention(q, kc, vc, t, n, return_lse=True, backend=b),
         _paged_reference, ATTENTION_BACKENDS, (0, 1, 2), {"D": REFUSE_D}),
    Case("varlen_attention", SIZES, _packed,
         lambda b, q, k, v, cq, ck: ae.varlen_attention(q, k, v, cq, ck, return_lse=True, backend=b),
         _packed_reference, ATTENTION_BACKENDS, (0, 1, 2), {"D": REFUSE_D}),
    Case("cross_attention", SIZES, _qkv_mask,
         lambda b, q, k, v, m: ae.cross_attention(q, k, v, key_padding_mask=m, return_lse=True, backend=b),
         lambda q, k, v, m: attention(q, k, v, key_allowed(m)),
         ATTENTION_BACKENDS, (0, 1, 2), {"D": REFUSE_D}),
    Case("scaled_dot_product_attention", SIZES, lambda s, d, g: _qkv(s, d, g),
         lambda b, q, k, v: ae.scaled_dot_product_attention(q, k, v, return_lse=True, backend=b),
         lambda q, k, v: attention(q, k, v), ATTENTION_BACKENDS, (0, 1, 2), {"D": REFUSE_D}),
    Case("scaled_dot_product_attention", GQA_SIZES, _gqa,
         lambda b, q, k, v: ae.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True, backend=b),
         lambda q, k, v: attention(q, k, v), ATTENTION_BACKENDS, (0, 1, 2),
         {"E": REFUSE_D, "Hkv": "query has 4 heads and key/value 0"}, label="sdpa_gqa"),
    Case("scaled_dot_product_attention", SIZES, _qkv_mask,
         lambda b, q, k, v, m: ae.scaled_dot_product_attention(
             q, k, v, attn_mask=_causal(q.shape[2], k.shape[2]), key_padding_mask=m, return_lse=True, backend=b),
         lambda q, k, v, m: attention(q, k, v, key_allowed(m) & _causal(q.shape[2], k.shape[2])),
         ATTENTION_BACKENDS, (0, 1, 2), {"D": REFUSE_D}, label="sdpa_masks"),
    Case("scaled_dot_product_attention", SIZES, lambda s, d, g: _qkv(s, d, g),
         lambda b, q, k, v: ae.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.3, return_lse=True,
                                                            backend=b),
         lambda q, k, v: attention(q, k, v, _causal(q.shape[2], k.shape[2]), keep=_keep(q, k.shape[2], 0.3),
                                   dropout_p=0.3),
         ATTENTION_BACKENDS, (0, 1, 2), {"D": REFUSE_D}, label="sdpa_causal_dropout"),
    Case("scaled_dot_product_attention", BATCH_SIZES, _batch_dims,
         lambda b, q, k, v: ae.scaled_dot_product_attention(q, k, v, backend=b),
         lambda q, k, v: attention(_flat(q), _flat(k), _flat(v))[0].reshape(q.shape[:-1] + v.shape[-1:]),
         ("cpp",), (0, 1, 2), {"E": REFUSE_D}, label="sdpa_batch_dims"),
    Case("attention_state", SIZES, _qkv_mask,
         lambda b, q, k, v, m: tuple(ae.attention_state(q, k, v, key_padding_mask=m, backend=b)),
         lambda q, k, v, m: attention(q, k, v, key_allowed(m)),
         ATTENTION_BACKENDS, (0, 1, 2), {"D": REFUSE_D}),
    Case("update_state", SIZES, lambda s, d, g: _qkv(s, d, g) + _qkv(dict(s, N=2), d, g)[1:],
         lambda b, q, k, v, k0, v0: tuple(ae.update_state(
             ae.update_state(ae.empty_state(q, v.shape[-1]), q, k0, v0, backend=b), q, k, v, backend=b)),
         lambda q, k, v, k0, v0: attention(q, torch.cat([k0, k], 2), torch.cat([v0, v], 2)),
         ATTENTION_BACKENDS, (0, 1, 2, 3, 4), {"D": REFUSE_D}),
    Case("remove_from_state", SIZES, lambda s, d, g: _qkv(s, d, g) + _qkv(dict(s, N=2), d, g)[1:],
         lambda b, q, k, v, k0, v0: tuple(ae.remove_from_state(
             ae.attention_state(q, torch.cat([k0, k], 2), torch.cat([v0, v], 2), backend=b), q, k, v, backend=b)),
         lambda q, k, v, k0, v0: attention(q, k0, v0),
         ATTENTION_BACKENDS, (0, 3, 4), {"D": r"attn_ext\.attention_state: head dim D must be positive"}),
    Case("merge_states", dict(B=2, H=2, M=3, Dv=3), _states,
         lambda b, oa, la, ob, lb: tuple(ae.merge_states(ae.AttentionState(oa, la), ae.AttentionState(ob, lb),
                                                         backend=b)),
         _merge, ATTENTION_BACKENDS, (0, 1, 2, 3)),
    Case("stream_attention", SIZES, lambda s, d, g: _qkv(s, d, g),
         lambda b, q, k, v: tuple(ae.stream_attention(q, [(k[:, :, :2], v[:, :, :2]), (k[:, :, 2:], v[:, :, 2:])],
                                                      backend=b)),
         lambda q, k, v: attention(q, k, v), ATTENTION_BACKENDS, (0, 1, 2), {"D": REFUSE_D}),
    Case("empty_state", dict(B=2, H=2, M=3, D=4, Dv=3), lambda s, d, g: (randn(g, d, s["B"], s["H"], s["M"], s["D"]),
                                                                       s["Dv"]),
         lambda b, q, dv: tuple(ae.empty_state(q, dv)),
         lambda q, dv: attention(q, q[:, :, :0], q.new_zeros(q.shape[:2] + (0, dv)), scale=1.0)),
]


@pytest.mark.parametrize("case, dim, backend", params(CASES))
def test_attention_op_with_a_zero_dimension(case, dim, backend):
    check(case, dim, backend)


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_zero_heads_match_torch_sdpa(backend):
    # The reported case: torch returns empty results and gradients; so do we (no SIGFPE, no refusal).
    dtype = torch.float32 if backend == "triton" else F64
    leaves = [torch.randn(2, 0, 3, 4, dtype=dtype, requires_grad=True) for _ in range(3)]
    for enable_gqa in (False, True):
        ours = ae.scaled_dot_product_attention(*leaves, enable_gqa=enable_gqa, backend=backend)
        theirs = torch.nn.functional.scaled_dot_product_attention(*leaves, enable_gqa=enable_gqa)
        assert ours.shape == theirs.shape == (2, 0, 3, 4)
        grads = torch.autograd.grad(ours.sum(), leaves)
        assert [g.shape for g in grads] == [x.shape for x in leaves]
    out = ae.cross_attention(*leaves, backend=backend)
    assert [g.shape for g in torch.autograd.grad(out.sum(), leaves)] == [x.shape for x in leaves]


def test_no_states_and_no_chunks():
    q = torch.randn(1, 2, 3, 4, dtype=F64)
    with pytest.raises(ValueError, match=r"attn_ext\.merge_states: needs two states or a non-empty sequence"):
        ae.merge_states([])
    state = ae.merge_states([ae.attention_state(q, q, q)])
    torch.testing.assert_close(state.out, ae.attention_state(q, q, q).out)
    with pytest.raises(ValueError, match=r"attn_ext\.stream_attention: .*no chunk"):
        ae.stream_attention(q, [])


@pytest.mark.parametrize("dim", ["batch", "queries", "keys"])
def test_the_drop_in_module_with_a_zero_size_matches_torch(dim):
    sizes = dict(batch=2, queries=3, keys=4)
    sizes[dim] = 0
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=F64)
    ours = ae.nn.MultiheadAttention(8, 2, batch_first=True, dtype=F64)
    ours.load_state_dict(theirs.state_dict())
    q = torch.randn(sizes["batch"], sizes["queries"], 8, dtype=F64, requires_grad=True)
    kv = torch.randn(sizes["batch"], sizes["keys"], 8, dtype=F64, requires_grad=True)
    results = []
    for module in (ours, theirs):
        out, weights = module(q, kv, kv)
        grads = torch.autograd.grad(out.pow(2).sum() + weights.sum(), (q, kv, *module.parameters()))
        results.append((out, weights, grads))
    (out, weights, grads), (out_t, weights_t, grads_t) = results
    torch.testing.assert_close(out, out_t)
    torch.testing.assert_close(weights, weights_t)
    for a, b in zip(grads, grads_t):
        torch.testing.assert_close(a, b)
