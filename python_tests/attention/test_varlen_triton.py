"""``ae.varlen_attention`` on the Triton kernels (in the interpreter): one launch per kernel over the packed batch,
each sequence's queries over its own keys. Outputs, lse and gradients against the dense fp64 attention of each
sequence with FlashAttention's rule, for the keywords that apply per sequence (the causal rule top-left and
bottom-right, windows, soft cap, ALiBi per head or per sequence, grouped heads), with empty sequences (no queries,
no keys), one-row ones and sequences longer than a tile; the packed call is one op call, not one per sequence; the
op refuses what a packed batch does not take, by name.
"""
from __future__ import annotations

import pytest
import torch

import attn_ext as ae
from _helpers import assert_within_flash_rule
from attn_ext.ops.utils.triton import triton_unavailable_reason
from test_varlen_attention import packed, per_sequence

pytestmark = pytest.mark.skipif(triton_unavailable_reason("cpu") is not None,
                                reason=f"Triton interpreter unavailable: {triton_unavailable_reason('cpu')}")

LENGTHS = {"mixed": ([3, 0, 70, 1, 37], [5, 4, 45, 0, 80]), "tiles": ([130, 20], [64, 150])}
CASES = {  # is_causal, window, alignment, softcap, alibi
    "plain": (False, None, "top_left", None, None),
    "causal": (True, None, "top_left", None, None),
    "causal bottom-right": (True, None, "bottom_right", None, None),
    "window cap alibi": (True, (9, 0), "top_left", 2.0, "heads"),
    "two-sided bottom-right alibi": (False, (6, 4), "bottom_right", None, "batch"),
}


def _slopes(alibi, batch, heads=4):
    if alibi == "heads":
        return torch.tensor([0.5, 0.25, 0.125, 0.0625])[:heads]
    if alibi == "batch":
        return torch.rand(batch, heads, generator=torch.Generator().manual_seed(5))
    return None


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("case", list(CASES))
def test_each_sequence_equals_its_own_attention(case, lengths, chunk_size):
    is_causal, window, alignment, softcap, alibi = CASES[case]
    q64, k64, v64, cu_q, cu_k = packed(*LENGTHS[lengths], D=16, Dv=8)
    slopes = _slopes(alibi, len(cu_q) - 1)
    kw = dict(is_causal=is_causal, window_size=window, alignment=alignment, softcap=softcap, alibi_slopes=slopes)
    q, k, v = (t.float().requires_grad_() for t in (q64, k64, v64))
    out = ae.varlen_attention(q, k, v, cu_q, cu_k, chunk_size=chunk_size, backend="triton", **kw)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    same = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = per_sequence(*leaves64, cu_q, cu_k, is_causal, window, alignment, softcap, slopes)
    pt = per_sequence(*same, cu_q, cu_k, is_causal, window, alignment, softcap, slopes)
    assert_within_flash_rule(out.detach(), ref.detach(), pt.detach(), name="out")
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    for a, r, p, name in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, leaves64, g.double()),
                             torch.autograd.grad(pt, same, g), "qkv"):
        assert_within_flash_rule(a, r, p, grad=True, name=f"d{name}")


@pytest.mark.parametrize("case", list(CASES))
def test_sequences_of_one_and_two_rows(case):
    # Tiny sequences, where PyTorch's own fp32 error is a few ulp (a sum of one or two terms) and FlashAttention's
    # rule would judge the backward's Δ = dO·out against it: compared with fp64 within fp32 rounding instead.
    is_causal, window, alignment, softcap, alibi = CASES[case]
    q64, k64, v64, cu_q, cu_k = packed([1, 2, 0], [1, 3, 2], D=16, Dv=8)
    slopes = _slopes(alibi, 3)
    kw = dict(is_causal=is_causal, window_size=window, alignment=alignment, softcap=softcap, alibi_slopes=slopes)
    leaves = [t.float().requires_grad_() for t in (q64, k64, v64)]
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    out = ae.varlen_attention(*leaves, cu_q, cu_k, backend="triton", **kw)
    ref = per_sequence(*leaves64, cu_q, cu_k, is_causal, window, alignment, softcap, slopes)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-6)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    for a, r in zip(torch.autograd.grad(out, leaves, g), torch.autograd.grad(ref, leaves64, g.double())):
        torch.testing.assert_close(a.double(), r, rtol=0, atol=4e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_and_the_lse(dtype):
    q64, k64, v64, cu_q, cu_k = packed(*LENGTHS["mixed"], D=16, Dv=8)
    q, k, v = (t.to(dtype) for t in (q64, k64, v64))
    out, lse = ae.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True, alignment="bottom_right", return_lse=True,
                                   backend="triton")
    theirs, lse_ref = ae.varlen_attention(q64, k64, v64, cu_q, cu_k, is_causal=True, alignment="bottom_right",
                                          return_lse=True, backend="reference")
    pt = ae.varlen_attention(q.float(), k.float(), v.float(), cu_q, cu_k, is_causal=True, alignment="bottom_right",
                             backend="reference").to(dtype)
    assert_within_flash_rule(out, theirs, pt, name="out")
    assert lse.shape == lse_ref.shape and torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    finite = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse[finite].double(), lse_ref[finite], rtol=1e-2, atol=1e-2)


def test_one_op_call_for_the_whole_batch(monkeypatch):
    from attn_ext.ops.attention import triton_fwd

    calls = []
    original = triton_fwd.launch_forward
    monkeypatch.setattr(triton_fwd, "launch_forward", lambda *a, **kw: (calls.append(kw.get("packed")),
                                                                        original(*a, **kw))[1])
    q, k, v, cu_q, cu_k = (t.float() if t.is_floating_point() else t for t in packed(*LENGTHS["mixed"], D=16, Dv=8))
    ae.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True, backend="triton")
    assert len(calls) == 1 and calls[0] is not None and calls[0].sequences == 5 and calls[0].max_q == 70
    # Dropout is drawn per sequence: one call each (as the cpp backend does).
    calls.clear()
    ae.varlen_attention(q, k, v, cu_q, cu_k, dropout_p=0.2, backend="triton")
    assert len(calls) == 5 and all(c is None for c in calls)


def test_the_op_refuses_what_a_packed_batch_does_not_take():
    q64, k64, v64, cu_q, cu_k = packed(*LENGTHS["mixed"], D=16, Dv=8)
    q, k, v = (t.float().transpose(0, 1)[None] for t in (q64, k64, v64))
    op = torch.ops.attn_ext.attention_fwd_triton
    with pytest.raises(ValueError, match="no attn_mask or key padding"):
        op(q, k, v, None, torch.zeros(1, k.shape[2], dtype=torch.bool), 0.25, False, 0.0, None, 16, -1, -1, 0, 0.0,
           None, cu_q, cu_k, False)
    with pytest.raises(ValueError, match="diagonal"):
        op(q, k, v, None, None, 0.25, False, 0.0, None, 16, -1, -1, 3, 0.0, None, cu_q, cu_k, False)
    with pytest.raises(ValueError, match="cu_seqlens"):
        op(q, k, v, None, None, 0.25, False, 0.0, None, 16, -1, -1, 0, 0.0, None, cu_q, cu_k[:-1], False)
    with pytest.raises(ValueError, match="alibi_slopes"):
        op(q, k, v, None, None, 0.25, False, 0.0, None, 16, -1, -1, 0, 0.0, torch.ones(2, 4), cu_q, cu_k, False)


def test_opcheck_of_the_packed_triton_op():
    q, k, v, cu_q, cu_k = packed([3, 6], [4, 5], D=16, Dv=8, dtype=torch.float32)
    q4, k4, v4 = (t.transpose(0, 1)[None].contiguous() for t in (q, k, v))
    torch.library.opcheck(torch.ops.attn_ext.attention_fwd_triton,
                          (q4, k4, v4, None, None, 0.3, True, 0.0, None, 16, -1, -1, 0, 0.0, None, cu_q, cu_k, True))


@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(is_causal=True, alignment="bottom_right"),
                                dict(window_size=(3, 0))], ids=str)
def test_a_nan_value_row_reaches_only_the_rows_that_attend_it(kw):
    import math

    q, k, v, cu_q, cu_k = (t.float() if t.is_floating_point() else t for t in packed([20, 30], [25, 40], D=16, Dv=8))
    v[25 + 39, 0, 3] = math.nan  # the second sequence's last key: masked for most of its rows
    ours = ae.varlen_attention(q, k, v, cu_q, cu_k, backend="triton", **kw)
    ref = ae.varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k, backend="reference", **kw)
    assert torch.equal(torch.isnan(ours), torch.isnan(ref)) and not torch.isnan(ours[:20]).any()
    torch.testing.assert_close(ours.double().nan_to_num(), ref.nan_to_num(), rtol=1e-5, atol=1e-6)
