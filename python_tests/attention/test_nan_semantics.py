"""NaN and inf in ``ae.cross_attention``, forward and backward, on every backend: NaN lands exactly
where the rule puts it (docs/cross_attention.md, "NaN, inf and empty rows"), every other entry
equals the fp64 rule within the FlashAttention error rule, and the rule itself agrees with fp64 SDPA
except where the docs say it does not (padded keys, and queries of rows without keys).

The cases (``_nan_rule.poisoned``): NaN in a query row, a key, a value, padded keys; +inf in a
query or a key; a row whose scores are all −inf; finite inputs whose fp32 score overflows to −inf.
Every case also has a fully padded batch entry holding a NaN query beside the poisoned entry.
"""
import math

import pytest
import torch

import attn_ext as ae

from _helpers import ALL_BACKENDS, require_backend
from _nan_rule import (B, CASES, CHUNK, DV, H, M, N, assert_nan_rule, poisoned, rule_attention, rule_grads,
                       sdpa_math)

# Where each case's NaN must land, by hand: a typo in the rule reference must not pass unnoticed.
# (batch, head, query row) triples with NaN out, and whether their lse is NaN too.
EXPECTED_NAN_ROWS = {
    "clean": ([], False), "padded_nan": ([], False), "huge": ([], False), "neg_inf_scores": ([], False),
    "q_nan": ([(1, 1, 3)], True), "q_inf": ([(1, 1, 3)], True),
    "k_nan": ([(1, 1, m) for m in range(M)], True), "v_nan": ([(1, 1, m) for m in range(M)], False),
}


def _grads_out(seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, M, DV, generator=g), torch.randn(B, H, M, generator=g)


def _run(backend, q, k, v, mask, grads=None):
    require_backend(backend, q)
    leaves = [t.detach().clone().requires_grad_(grads is not None) for t in (q, k, v)]
    out, lse = ae.cross_attention(*leaves, key_padding_mask=mask, chunk_size=CHUNK, return_lse=True,
                                  backend=backend)
    if grads is None:
        return out, lse
    return torch.autograd.grad((out, lse), leaves, (grads[0].to(out.dtype), grads[1].to(lse.dtype)))


def _rows_with_nan(t):
    """(batch, head, row) of the rows of ``t`` (``[B, H, M]`` or ``[B, H, M, d]``) holding NaN."""
    nan = torch.isnan(t)
    return sorted(tuple(i) for i in (nan.any(-1) if nan.dim() == 4 else nan).nonzero().tolist())


def test_rule_reference_puts_nan_where_the_docs_say():
    for case in CASES:
        q, k, v, mask = poisoned(case, torch.float64)
        out, lse = rule_attention(q, k, v, mask)
        rows, lse_nan = EXPECTED_NAN_ROWS.get(case, (None, None))
        if case == "k_inf":  # +inf score where q[..., 0] > 0, weight 0 where < 0: both kinds occur
            rows = [(1, 1, m) for m in range(M) if q[1, 1, m, 0] > 0]
            assert 0 < len(rows) < M
            lse_nan = True
        assert _rows_with_nan(out) == rows, case
        assert _rows_with_nan(lse) == (rows if lse_nan else []), case
        if case == "v_nan":  # only the poisoned column
            assert torch.isnan(out[1, 1]).all(0).tolist() == [c == 1 for c in range(DV)]
        assert bool((out[0] == 0).all()) and bool(torch.isneginf(lse[0]).all()), f"{case}: entry 0 not empty"
        if case == "neg_inf_scores":  # no key carries weight: empty, like a fully padded row
            assert float(lse[1, 1, 3]) == -math.inf and bool((out[1, 1, 3] == 0).all())


@pytest.mark.parametrize("case", CASES)
def test_rule_agrees_with_fp64_sdpa_except_where_documented(case):
    q, k, v, mask = poisoned(case, torch.float64)
    ours, _ = rule_attention(q, k, v, mask)
    sdpa = sdpa_math(q, k, v, mask)
    differs = torch.zeros(B, H, M, DV, dtype=torch.bool)
    # A row without valid keys never reads its query: 0, where SDPA's NaN + (−inf) mask gives NaN.
    differs[0, 0, 2] = True
    if case == "padded_nan":  # SDPA's math path reads padded keys: 0 · NaN and NaN − inf leak into entry 1
        differs[1] = True
    assert torch.equal(torch.isnan(sdpa), torch.isnan(ours) | differs), case
    assert bool((torch.isnan(sdpa) == differs)[differs].all()), f"{case}: a documented difference vanished"
    same = ~differs & ~torch.isnan(ours)
    torch.testing.assert_close(ours[same], sdpa[same], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_rule_gradients_agree_with_fp64_sdpa_except_where_documented(case):
    q, k, v, mask = poisoned(case, torch.float64)
    grad_out, _ = _grads_out()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sdpa = torch.autograd.grad(sdpa_math(*leaves, mask), leaves, grad_out.double())
    ours = rule_grads(q, k, v, mask, grad_out, torch.zeros(B, H, M))
    for name, a, b in zip(("dq", "dk", "dv"), sdpa, ours):
        differs = torch.zeros_like(a, dtype=torch.bool)
        differs[0] = True  # SDPA reads the NaN query of the row without valid keys
        if name != "dq":  # SDPA's padded keys get 0 · NaN from NaN rows (here: exact zeros)
            differs |= mask[:, None, :, None]
        if case == "padded_nan":
            differs[1] = True
        assert not bool((torch.isnan(b) & ~torch.isnan(a)).any()), f"{case} {name}: NaN where SDPA has none"
        assert torch.equal(torch.isnan(a) & ~differs, torch.isnan(b) & ~differs), f"{case} {name}"
        same = ~differs & ~torch.isnan(b)
        torch.testing.assert_close(b[same], a[same], rtol=1e-9, atol=1e-9 * max(1.0, float(a[same].abs().max())))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_forward(backend, case):
    q, k, v, mask = poisoned(case)
    out, lse = _run(backend, q, k, v, mask)
    out64, lse64 = rule_attention(q.double(), k.double(), v.double(), mask)
    out32, lse32 = rule_attention(q, k, v, mask)
    assert_nan_rule(out, out64, out32, f"{backend} {case} out")
    assert_nan_rule(lse, lse64, lse32, f"{backend} {case} lse")
    assert bool((out[0] == 0).all()) and bool(torch.isneginf(lse[0]).all())


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_backward(backend, case):
    q, k, v, mask = poisoned(case)
    grads = _grads_out()
    ours = _run(backend, q, k, v, mask, grads)
    ref = rule_grads(q, k, v, mask, *grads)
    same = rule_grads(q, k, v, mask, *grads, dtype=torch.float32)
    for name, g, g64, g32 in zip(("dq", "dk", "dv"), ours, ref, same):
        assert_nan_rule(g, g64, g32, f"{backend} {case} {name}", grad=True)
    dq, dk, dv = ours
    padded = mask[:, None, :, None].expand(B, H, N, 1)
    assert bool((dq[0] == 0).all()), "rows without keys get zero gradient, NaN query or not"
    assert bool((dk.masked_select(padded) == 0).all()) and bool((dv.masked_select(padded) == 0).all())


def test_backward_nan_masks_by_hand():
    """The NaN-gradient facts the rule implies, stated without the reference (on cpp)."""
    grads = _grads_out()
    valid = ~poisoned("clean")[3][1]
    dq, dk, dv = _run("cpp", *poisoned("q_nan"), grads)
    assert _rows_with_nan(dq) == [(1, 1, 3)]  # the NaN row ...
    assert torch.isnan(dk[1, 1]).any(-1).tolist() == valid.tolist()  # ... reaches every key it attends to
    assert torch.isnan(dv[1, 1]).any(-1).tolist() == valid.tolist()
    assert not bool(torch.isnan(dk[:, 0]).any() or torch.isnan(dk[0]).any() or torch.isnan(dk[2]).any())
    dq, dk, dv = _run("cpp", *poisoned("v_nan"), grads)
    assert bool(torch.isnan(dq[1, 1]).all()) and not bool(torch.isnan(dv).any())  # P is finite: dv = Pᵀ dO
    dq, dk, dv = _run("cpp", *poisoned("neg_inf_scores"), grads)
    assert bool((dq[1, 1, 3] == 0).all()), "an empty row has zero gradient"
    assert not bool(torch.isnan(dq).any() or torch.isnan(dv).any())


@pytest.mark.parametrize("backend", ["cpp", "reference"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["q_nan", "k_nan", "v_nan", "padded_nan", "k_inf"])
def test_other_dtypes_put_nan_in_the_same_places(backend, dtype, case):
    q, k, v, mask = poisoned(case, dtype)
    out, lse = _run(backend, q, k, v, mask)
    out64, lse64 = rule_attention(q.double(), k.double(), v.double(), mask)
    assert torch.equal(torch.isnan(out), torch.isnan(out64)) and torch.equal(torch.isnan(lse), torch.isnan(lse64))
    if dtype == torch.float64:  # fp64 kernels: the rule to rounding
        assert_nan_rule(out, out64, None, f"{backend} {case} out")
        assert_nan_rule(lse, lse64, None, f"{backend} {case} lse")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_no_keys_at_all_is_empty_with_zero_gradients(backend):
    q = torch.randn(2, 2, 3, 8)
    q[0, 0, 1] = math.nan  # a query with nothing to attend to is never read
    k, v = torch.randn(2, 2, 0, 8), torch.randn(2, 2, 0, 4)
    out, lse = _run(backend, q, k, v, None)
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())
    dq, _, _ = _run(backend, q, k, v, None, (torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3)))
    assert bool((dq == 0).all())


def test_cpp_key_splits_keep_nan_and_padding_rules():
    """Long keys, few rows: the cpp kernels split the keys over threads and merge partial states."""
    threads = torch.get_num_threads()
    torch.set_num_threads(4)  # ask for splits (they depend on the thread count, not on the machine)
    try:
        g = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(2, 2, 4, 64, generator=g), torch.randn(2, 2, 8192, 64, generator=g),
                   torch.randn(2, 2, 8192, 64, generator=g))
        mask = torch.zeros(2, 8192, dtype=torch.bool)
        mask[0, :4096] = True  # entry 0: the first half (one split) fully padded ...
        k[0, :, 100] = math.nan  # ... holding garbage
        v[0, :, 4000:4096] = math.nan
        k[0, 1, 6000, 3] = math.nan  # and a NaN key in the other half of head 1
        mask[1] = True  # entry 1: no key at all
        grads = (torch.randn(2, 2, 4, 64, generator=g), torch.randn(2, 2, 4, generator=g))
        out, lse = _run("cpp", q, k, v, mask)
        scale = 1 / 8  # the default 1/sqrt(D), which the rule helpers take for D = 8
        out64, lse64 = rule_attention(q.double(), k.double(), v.double(), mask, scale)
        out32, lse32 = rule_attention(q, k, v, mask, scale)
        assert _rows_with_nan(out) == _rows_with_nan(lse) == [(0, 1, m) for m in range(4)]
        assert_nan_rule(out, out64, out32, "split out")
        assert_nan_rule(lse, lse64, lse32, "split lse")
        ours = _run("cpp", q, k, v, mask, grads)
        for name, a, b64, b32 in zip("qkv", ours, rule_grads(q, k, v, mask, *grads, scale=scale),
                                     rule_grads(q, k, v, mask, *grads, dtype=torch.float32, scale=scale)):
            assert_nan_rule(a, b64, b32, f"split d{name}", grad=True)
    finally:
        torch.set_num_threads(threads)
