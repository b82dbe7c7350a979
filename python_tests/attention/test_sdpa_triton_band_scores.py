"""The Triton kernels' sliding windows, offset causal rule, soft cap and ALiBi (``window_size``, ``alignment``,
``softcap``, ``alibi_slopes``), in the interpreter: forward and backward against the dense fp64 definition with
FlashAttention's rule, each alone and combined with each other, with an additive mask, key padding, grouped heads and
dropout (the same keep mask as the reference backend's); bands several tiles wide and narrower than one tile, both
key tile widths (``chunk_size`` 16 and 64, query tiles of 32 rows), ``L < S`` and ``L > S``; rows the band leaves
empty; a non-finite value row outside a query's band does not reach it; derivatives of every order through the op;
the kernels' key and query ranges skip the blocks outside the band.
"""
from __future__ import annotations

import math

import pytest
import torch

import attn_ext as ae
from _helpers import assert_within_flash_rule
from attn_ext.ops.utils.triton import triton_unavailable_reason
from test_sdpa_score_mods import dense, slopes_for
from test_sdpa_window import band_mask

pytestmark = pytest.mark.skipif(triton_unavailable_reason("cpu") is not None,
                                reason=f"Triton interpreter unavailable: {triton_unavailable_reason('cpu')}")

CASES = {  # softcap, alibi (None | "heads" | "batch"), is_causal, window, alignment
    "window": (None, None, False, (20, 7), "top_left"),
    "causal bottom-right": (None, None, True, None, "bottom_right"),
    "causal window": (None, None, True, (24, 0), "bottom_right"),
    "softcap": (2.0, None, False, None, "top_left"),
    "alibi": (None, "batch", False, None, "top_left"),
    "all": (1.5, "heads", True, (40, 0), "bottom_right"),
    "one-sided right": (None, None, False, (-1, 5), "top_left"),
}


def _inputs(B, Hq, Hkv, L, S, D, Dv, dtype=torch.float32, seed=0, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    return (spread * torch.randn(B, Hq, L, D, generator=g)).to(dtype), torch.randn(B, Hkv, S, D, generator=g).to(
        dtype), torch.randn(B, Hkv, S, Dv, generator=g).to(dtype)


def _check(case, L, S, chunk_size, dtype=torch.float32):
    softcap, alibi, is_causal, window, alignment = case
    B, Hq, Hkv, D, Dv = 2, 4, 2, 16, 8
    q, k, v = (t.requires_grad_() for t in _inputs(B, Hq, Hkv, L, S, D, Dv, dtype))
    slopes = None if alibi is None else slopes_for(B, Hq, alibi == "batch")
    kwargs = dict(softcap=softcap, alibi_slopes=slopes, is_causal=is_causal, window_size=window, alignment=alignment,
                  enable_gqa=True)
    out = ae.scaled_dot_product_attention(q, k, v, chunk_size=chunk_size, backend="triton", **kwargs)
    mask = band_mask(L, S, is_causal, window, alignment)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    same = [t.detach().requires_grad_() for t in (q, k, v)]
    ref, pt = dense(*leaves64, softcap, slopes, mask, alignment), dense(*same, softcap, slopes, mask, alignment)
    assert_within_flash_rule(out.detach(), ref.detach(), pt.detach(), name="out")
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    for a, r, p, name in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, leaves64, g.double()),
                             torch.autograd.grad(pt, same, g), "qkv"):
        assert_within_flash_rule(a, r, p, grad=True, name=f"d{name}")


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("L, S", [(70, 130), (100, 45)], ids=["L<S", "L>S"])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_backward_equal_the_definition(case, L, S, chunk_size):
    _check(CASES[case], L, S, chunk_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_flash_rule_half_precision(dtype):
    _check(CASES["all"], 48, 80, 16, dtype)


def test_with_a_float_mask_padding_and_dropout_as_the_reference():
    B, Hq, Hkv, L, S, D, Dv = 2, 4, 2, 37, 66, 16, 8
    q, k, v = (t.double() for t in _inputs(B, Hq, Hkv, L, S, D, Dv))
    g = torch.Generator().manual_seed(3)
    mask = torch.randn(1, Hq, L, S, generator=g, dtype=torch.float64).masked_fill(
        torch.rand(1, Hq, L, S, generator=g) < 0.1, -math.inf)
    padding = torch.zeros(B, S, dtype=torch.bool)
    padding[0, -9:] = True
    slopes = slopes_for(B, Hq)
    common = dict(key_padding_mask=padding, softcap=2.0, alibi_slopes=slopes, window_size=(30, 2),
                  alignment="bottom_right", enable_gqa=True, return_lse=True)
    for dropout_p in (0.0, 0.3):
        res = []
        for backend in ("triton", "reference"):
            leaves = [t.float().requires_grad_() if backend == "triton" else t.clone().requires_grad_()
                      for t in (q, k, v)]
            torch.manual_seed(11)
            out, lse = ae.scaled_dot_product_attention(*leaves, attn_mask=mask.to(leaves[0].dtype),
                                                       dropout_p=dropout_p, chunk_size=16, backend=backend, **common)
            grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
            res.append([out.double(), lse.double(), *(gr.double() for gr in grads)])
        for a, b, name in zip(*res, ("out", "lse", "dq", "dk", "dv")):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5, msg=lambda m, name=name: f"p={dropout_p} {name}: {m}")


def test_rows_the_band_leaves_empty():
    # bottom-right with L > S: the first L - S queries' diagonal keys lie before key 0, and a window (0, 0) of
    # the next ones holds one key each.
    B, H, L, S, D = 1, 2, 40, 24, 16
    q, k, v = (t.requires_grad_() for t in _inputs(B, H, H, L, S, D, D))
    out, lse = ae.scaled_dot_product_attention(q, k, v, window_size=(0, 0), alignment="bottom_right",
                                               return_lse=True, chunk_size=16, backend="triton")
    empty = L - S
    assert torch.equal(out[:, :, :empty], torch.zeros_like(out[:, :, :empty]))
    assert torch.isneginf(lse[:, :, :empty]).all() and torch.isfinite(lse[:, :, empty:]).all()
    torch.testing.assert_close(out[:, :, empty:], v.detach(), rtol=0, atol=0)  # one key each: its value
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    # A weight of 1 whatever the score: dq and dk vanish (up to the rounding of dO·v − dO·out), dv is dO.
    torch.testing.assert_close(dq, torch.zeros_like(dq), rtol=0, atol=1e-5)
    torch.testing.assert_close(dk, torch.zeros_like(dk), rtol=0, atol=1e-5)
    torch.testing.assert_close(dv, torch.ones_like(dv), rtol=0, atol=0)
    assert torch.equal(dq[:, :, :empty], torch.zeros_like(dq[:, :, :empty]))  # the empty rows: exactly


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nonfinite_value_outside_the_band_reaches_no_other_row(bad):
    B, H, L, S, D = 1, 2, 64, 64, 16
    q, k, v = _inputs(B, H, H, L, S, D, D)
    v[:, :, 5] = bad
    out = ae.scaled_dot_product_attention(q, k, v, window_size=(8, 0), chunk_size=16, backend="triton")
    sees = band_mask(L, S, False, (8, 0))[:, 5]  # the queries whose band holds key 5
    assert not torch.isfinite(out[:, :, sees]).all()
    assert torch.isfinite(out[:, :, ~sees]).all()
    ref = ae.scaled_dot_product_attention(q, k, v, window_size=(8, 0), backend="reference")
    torch.testing.assert_close(out[:, :, ~sees], ref[:, :, ~sees], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window, alignment, L, S", [((16, 0), "top_left", 128, 128), ((0, 40), "bottom_right", 64, 200),
                                                     ((3, 3), "top_left", 96, 40)])
def test_kernels_visit_only_the_blocks_the_band_reaches(window, alignment, L, S):
    """The kernels' own range functions (``band_keys`` for the forward and dQ, ``band_queries`` for dK/dV, run in a
    probe kernel) cover every allowed pair and, for a narrow band, about the band's width per row, not S."""
    from attn_ext.ops.attention.band import Band
    from attn_ext.ops.attention.triton_score_mod import score_args

    probe = _range_probe()

    diagonal = S - L if alignment == "bottom_right" else 0
    band_lo, band_hi = score_args(Band.of(False, *window, diagonal), 0.0, None, diagonal, L, S, torch.empty(0)).args[:2]
    allowed = band_mask(L, S, False, window, alignment)
    bm, bn = 32, 16
    out = torch.zeros(2, dtype=torch.int32)
    visited = torch.zeros(L, S, dtype=torch.bool)
    for m0 in range(0, L, bm):
        probe[(1,)](out, m0, S, band_lo, band_hi, BLOCK_ROWS=bm, BLOCK_OTHER=bn, KEYS=True)
        lo, hi = out.tolist()
        assert lo % bn == 0
        visited[m0:m0 + bm, max(lo, 0):max(hi, 0)] = True
    assert not (allowed & ~visited).any()
    assert visited.sum() <= allowed.sum() + (bm + bn) * L  # the band's width (and a tile) per query, not S
    seen = torch.zeros(L, S, dtype=torch.bool)
    for n0 in range(0, S, bn):
        probe[(1,)](out, n0, L, band_lo, band_hi, BLOCK_ROWS=bn, BLOCK_OTHER=bm, KEYS=False)
        lo, hi = out.tolist()
        assert lo % bm == 0
        seen[max(lo, 0):max(hi, 0), n0:n0 + bn] = True
    assert not (allowed & ~seen).any()
    assert seen.sum() <= allowed.sum() + (bm + bn) * S


def _range_probe():
    """A kernel that stores what ``band_keys`` (``KEYS``) or ``band_queries`` returns for one block."""
    import triton
    import triton.language as tl

    global _PROBE
    if _PROBE is None:
        from attn_ext.ops.attention.triton_score_mod import band_keys, band_queries

        globals().update(band_keys=band_keys, band_queries=band_queries)  # a jit function reads module globals

        @triton.jit
        def probe(OUT, first, total, band_lo, band_hi, BLOCK_ROWS: tl.constexpr, BLOCK_OTHER: tl.constexpr,
                  KEYS: tl.constexpr):
            if KEYS:
                lo, hi = band_keys(first, BLOCK_ROWS, total, band_lo, band_hi, BLOCK_OTHER)
            else:
                lo, hi = band_queries(first, BLOCK_ROWS, total, band_lo, band_hi, BLOCK_OTHER)
            tl.store(OUT, lo)
            tl.store(OUT + 1, hi)

        _PROBE = probe
    return _PROBE


_PROBE = None
