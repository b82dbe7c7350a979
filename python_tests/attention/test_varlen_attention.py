"""``ae.varlen_attention``: a packed batch (FlashAttention's ``cu_seqlens`` layout) equals the dense fp64 attention of
each sequence on its own, outputs, lse and gradients, for the keywords that apply per sequence (causal rule and
windows aligned per sequence, soft cap, ALiBi per head or per sequence, grouped heads), with empty and one-row
sequences; derivatives of every order; every malformed offset or hint refused by name."""
import pytest
import torch

import attn_ext as ae
from _sdpa_ref import attention_ops, backends, require
from test_sdpa_score_mods import dense
from test_sdpa_window import band_mask

F64 = torch.float64


def packed(lengths_q, lengths_k, H=4, Hkv=2, D=8, Dv=6, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lengths_q), sum(lengths_k)
    q = torch.randn(tq, H, D, generator=g).to(dtype)
    k = torch.randn(tk, Hkv, D, generator=g).to(dtype)
    v = torch.randn(tk, Hkv, Dv, generator=g).to(dtype)
    cu = lambda ls: torch.tensor([0] + torch.tensor(ls).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    return q, k, v, cu(lengths_q), cu(lengths_k)


def per_sequence(q, k, v, cu_q, cu_k, is_causal=False, window=None, alignment="top_left", softcap=None, slopes=None):
    """out [total_q, H, Dv] from the definition, one sequence at a time (a row without a key: 0)."""
    outs = []
    for b in range(len(cu_q) - 1):
        qb = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1)[None]
        kb = k[cu_k[b]:cu_k[b + 1]].transpose(0, 1)[None]
        vb = v[cu_k[b]:cu_k[b + 1]].transpose(0, 1)[None]
        L, S = qb.shape[2], kb.shape[2]
        sl = slopes[b] if slopes is not None and slopes.dim() == 2 else slopes
        mask = band_mask(L, S, is_causal, window, alignment).to(q.device)
        outs.append(dense(qb, kb, vb, softcap, sl, mask, alignment)[0].transpose(0, 1))
    return torch.cat(outs, 0)


LENGTHS = [([3, 0, 10, 1, 7], [5, 4, 10, 1, 12]), ([1], [1]), ([9, 4], [4, 9])]
CASES = [  # is_causal, window, alignment, softcap, alibi
    (False, None, "top_left", None, None),
    (True, None, "bottom_right", None, None),
    (True, (3, 0), "top_left", 2.0, "heads"),
    (False, (2, 2), "bottom_right", None, "batch"),
]


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_each_sequence_equals_its_own_attention(backend, lengths, case):
    is_causal, window, alignment, softcap, alibi = case
    q, k, v, cu_q, cu_k = packed(*lengths)
    require(backend, q)
    B = len(lengths[0])
    slopes = None
    if alibi == "heads":
        slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    elif alibi == "batch":
        slopes = torch.rand(B, 4, generator=torch.Generator().manual_seed(1))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out, lse = ae.varlen_attention(*leaves, cu_q, cu_k, max(lengths[0]), max(lengths[1]), is_causal=is_causal,
                                   window_size=window, alignment=alignment, softcap=softcap, alibi_slopes=slopes,
                                   return_lse=True, chunk_size=4, backend=backend)
    assert out.shape == (q.shape[0], 4, 6) and lse.shape == (4, q.shape[0])
    ref = per_sequence(*leaves, cu_q.tolist(), cu_k.tolist(), is_causal, window, alignment, softcap, slopes)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    g = torch.randn_like(out)
    for a, b, name in zip(torch.autograd.grad(out, leaves, g), torch.autograd.grad(ref, leaves, g), "qkv"):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=lambda m, name=name: f"d{name}: {m}")


def test_lse_is_each_sequences_own():
    q, k, v, cu_q, cu_k = packed([4, 6], [5, 3])
    _, lse = ae.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True)
    for b, (q0, q1, k0, k1) in enumerate([(0, 4, 0, 5), (4, 10, 5, 8)]):
        _, ref = ae.scaled_dot_product_attention(q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1),
                                                 v[k0:k1].transpose(0, 1), enable_gqa=True, return_lse=True)
        torch.testing.assert_close(lse[:, q0:q1], ref, rtol=0, atol=0)


def test_gradcheck_and_gradgradcheck():
    q, k, v, cu_q, cu_k = packed([2, 3], [3, 4], H=2, Hkv=1, D=3, Dv=2)  # no row without a key (lse -inf)
    leaves = tuple(t.requires_grad_() for t in (q, k, v))

    def f(q, k, v):
        return ae.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True, alignment="bottom_right", softcap=1.5,
                                   return_lse=True)

    assert torch.autograd.gradcheck(f, leaves)
    assert torch.autograd.gradgradcheck(f, leaves)


def test_empty_batch_and_empty_sequences():
    q, k, v, cu_q, cu_k = packed([0, 0], [2, 0])
    out, lse = ae.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True)
    assert out.shape == (0, 4, 6) and lse.shape == (4, 0)
    q, k, v, cu_q, cu_k = packed([3], [0])
    out, lse = ae.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("change, error, match", [
    (lambda a: dict(a, cu_seqlens_q=a["cu_seqlens_q"].long()), TypeError, "int32"),
    (lambda a: dict(a, cu_seqlens_q=torch.tensor([1, 3, 10], dtype=torch.int32)), ValueError, "start at 0"),
    (lambda a: dict(a, cu_seqlens_k=torch.tensor([0, 9, 8], dtype=torch.int32)), ValueError, "never decrease"),
    (lambda a: dict(a, cu_seqlens_q=torch.tensor([0, 3, 9], dtype=torch.int32)), ValueError, "end at"),
    (lambda a: dict(a, cu_seqlens_k=torch.tensor([0, 8], dtype=torch.int32)), ValueError, "same number"),
    (lambda a: dict(a, max_seqlen_q=5), ValueError, "max_seqlen_q"),
    (lambda a: dict(a, q=a["q"][None]), ValueError, "packed"),
    (lambda a: dict(a, v=a["v"][:-1]), ValueError, "same rows"),
    (lambda a: dict(a, alibi_slopes=torch.ones(3, 4)), ValueError, "alibi_slopes"),
])
def test_malformed_arguments_are_named(change, error, match):
    q, k, v, cu_q, cu_k = packed([3, 7], [4, 4])
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    with pytest.raises(error, match=match):
        ae.varlen_attention(**change(args))


@pytest.mark.parametrize("backend", backends())
def test_one_packed_call_equals_one_call_per_sequence(backend, monkeypatch):
    from attn_ext.ops.attention import varlen

    q, k, v, cu_q, cu_k = packed([5, 0, 33, 2], [9, 3, 20, 2])
    require(backend, q)
    kwargs = dict(is_causal=True, window_size=(4, 0), alignment="bottom_right", softcap=2.5,
                  alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]), return_lse=True, chunk_size=8,
                  backend=backend)
    calls = []
    real = varlen._fused
    monkeypatch.setattr(varlen, "_fused", lambda *a: calls.append(1) or real(*a))
    out, lse = ae.varlen_attention(q, k, v, cu_q, cu_k, **kwargs)
    assert calls  # the packed call ran (it returns None where it does not apply)
    monkeypatch.setattr(varlen, "_fused", lambda *a: None)
    out_loop, lse_loop = ae.varlen_attention(q, k, v, cu_q, cu_k, **kwargs)
    torch.testing.assert_close(out, out_loop, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(lse, lse_loop, rtol=1e-12, atol=1e-13)


def test_opcheck_of_the_packed_op():
    q, k, v, cu_q, cu_k = packed([3, 6], [4, 5], dtype=torch.float32)
    q4, k4, v4 = (t.transpose(0, 1)[None].contiguous() for t in (q, k, v))
    for op in attention_ops():
        torch.library.opcheck(op, (q4, k4, v4, None, None, 0.3, True, 0.0, None, 4, -1, -1, 0, 0.0, None, cu_q, cu_k,
                                   True))


def test_the_packed_op_refuses_what_it_does_not_take():
    q, k, v, cu_q, cu_k = packed([3, 6], [4, 5])
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))
    for op in attention_ops():
        with pytest.raises(ValueError, match="dropout"):
            op(q4, k4, v4, None, None, 0.3, False, 0.2, torch.tensor([1]), 4, -1, -1, 0, 0.0, None, cu_q, cu_k, False)
        with pytest.raises(ValueError, match="diagonal"):
            op(q4, k4, v4, None, None, 0.3, False, 0.0, None, 4, -1, -1, 3, 0.0, None, cu_q, cu_k, False)
        with pytest.raises(ValueError, match="end at the packed rows|start at 0"):
            op(q4, k4, v4, None, None, 0.3, False, 0.0, None, 4, -1, -1, 0, 0.0, None,
               torch.tensor([0, 3, 8], dtype=torch.int32), cu_k, False)
