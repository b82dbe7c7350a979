"""The Triton forward split over keys (decoding: :mod:`attn_ext.ops.attention.triton_split_keys`), in the interpreter
with the number of parts forced (a GPU chooses it by shape): each part's partial state merged gives the fp64 dense
definition within FlashAttention's rule and the unsplit kernel's result within rounding, for plain, bottom-right
causal, windowed (parts from the band's first key), soft-capped and ALiBi calls with grouped heads and key padding;
rows without keys (0, -inf), a NaN query row, and a masked non-finite value row (the fix-up launch on the merged
rows) keep the library's rules; the choice of parts by shape, and the merge's own rules.
"""
from __future__ import annotations

import math

import pytest
import torch

from _helpers import assert_within_flash_rule
from attn_ext.ops.attention import triton_split_keys
from attn_ext.ops.attention.band import Band
from attn_ext.ops.utils.triton import triton_unavailable_reason
from test_sdpa_score_mods import dense, slopes_for
from test_sdpa_window import band_mask

pytestmark = pytest.mark.skipif(triton_unavailable_reason("cpu") is not None,
                                reason=f"Triton interpreter unavailable: {triton_unavailable_reason('cpu')}")


def _forward(q, k, v, *, parts=None, is_causal=False, window=None, alignment="top_left", softcap=None, slopes=None,
             padding=None, attn_mask=None, scale=0.25):
    """``launch_forward`` as the op calls it (the band and score modifications made by ``kernel_scores``)."""
    from attn_ext.ops.attention.scaled_dot_product import window_sides
    from attn_ext.ops.attention.triton_fwd import launch_forward
    from attn_ext.ops.attention.triton_score_mod import kernel_scores

    L, S = q.shape[2], k.shape[2]
    left, right = window_sides(window, alignment, is_causal)
    diagonal = S - L if alignment == "bottom_right" else 0
    band = Band.of(is_causal, left, right, diagonal)
    scores = kernel_scores(band, is_causal, softcap or 0.0, slopes, diagonal, q, k)
    mask = None if attn_mask is None else attn_mask.expand(q.shape[0], q.shape[1], L, S)
    return launch_forward(q, k, v, padding, scale, 64, attn_mask=mask, is_causal=is_causal and not scores.window,
                          scores=scores, key_parts=parts)


CASES = {  # is_causal, window, alignment, softcap, alibi
    "plain": (False, None, "top_left", None, False),
    "causal bottom-right": (True, None, "bottom_right", None, False),
    "window bottom-right": (True, (300, 0), "bottom_right", None, False),
    "softcap alibi": (False, None, "top_left", 2.0, True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("parts", [2, 5])
def test_parts_merged_equal_the_definition_and_the_unsplit_kernel(case, parts):
    is_causal, window, alignment, softcap, alibi = CASES[case]
    B, Hq, Hkv, L, S, D = 2, 4, 2, 3, 900, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (3 * torch.randn(B, Hq, L, D, generator=g), torch.randn(B, Hkv, S, D, generator=g),
               torch.randn(B, Hkv, S, D, generator=g))
    padding = torch.rand(B, S, generator=g) < 0.2
    slopes = slopes_for(B, Hq, True) if alibi else None
    kw = dict(is_causal=is_causal, window=window, alignment=alignment, softcap=softcap, slopes=slopes, padding=padding)
    split = _key_split(q, k, *_kernel_band(L, S, is_causal, window, alignment), parts)
    assert split is not None and split.parts > 1 and split.length % 128 == 0 and split.base % 128 == 0
    out, lse = _forward(q, k, v, parts=parts, **kw)
    whole, whole_lse = _forward(q, k, v, **kw)
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-5, atol=1e-5)
    mask = band_mask(L, S, is_causal, window, alignment) & ~padding[:, None, None, :]
    k_rep, v_rep = (t.repeat_interleave(Hq // Hkv, 1) for t in (k, v))
    ref = dense(q.double(), k_rep.double(), v_rep.double(), softcap, slopes, mask, alignment, scale=0.25)
    same = dense(q, k_rep, v_rep, softcap, slopes, mask, alignment, scale=0.25)
    assert_within_flash_rule(out, ref, same, name="out")


def _key_split(q, k, *band_and_parts):
    """``key_split`` of a call's q ``[B, H, L, D]`` and k ``[B, Hkv, S, D]``."""
    return triton_split_keys.key_split(q.shape[0] * q.shape[1], q.shape[2], k.shape[2], q.device, *band_and_parts)


def _kernel_band(L, S, is_causal, window, alignment):
    """``(is_causal, window, band_lo, band_hi)`` as the forward hands them to ``key_split`` (kernel_scores' band:
    the top-left causal rule alone is ``IS_CAUSAL``, any other band a window)."""
    from attn_ext.ops.attention.scaled_dot_product import window_sides
    from attn_ext.ops.attention.triton_score_mod import kernel_scores

    left, right = window_sides(window, alignment, is_causal)
    diagonal = S - L if alignment == "bottom_right" else 0
    q, k = torch.zeros(1, 1, L, 1), torch.zeros(1, 1, S, 1)
    scores = kernel_scores(Band.of(is_causal, left, right, diagonal), is_causal, 0.0, None, diagonal, q, k)
    return is_causal and not scores.window, scores.window, scores.args[0], scores.args[1]


def test_parts_start_at_the_band_and_cover_only_reachable_keys():
    q, k = torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 10_000, 8)
    # A window (300, 0) aligned at the end: keys 9,698 .. 9,999 only, from a multiple of 128 below.
    split = _key_split(q, k, *_kernel_band(2, 10_000, True, (300, 0), "bottom_right"), 2)
    assert split.base == 9_698 // 128 * 128 and split.base + split.parts * split.length >= 10_000
    # Top-left causal: the queries see the first two keys, nothing to split.
    assert _key_split(q, k, *_kernel_band(2, 10_000, True, None, "top_left"), 4) is None
    # Not forced: never under the interpreter or on CPU tensors.
    assert _key_split(q, k, False, False, 0, 0) is None


def test_automatic_parts_fill_the_device_only_for_decoding_shapes():
    parts = triton_split_keys.automatic_parts
    assert parts(8, 1, 1_000_000, 132) == math.ceil(2 * 132 / 8)  # B·H = 8: 33 parts of ~30k keys
    assert parts(8, 1, 20_000, 132) == 20_000 // triton_split_keys.MIN_PART_KEYS  # parts of 2,048 keys at least
    assert parts(8, 17, 1_000_000, 132) == 1  # more queries than decoding: no split
    assert parts(256, 1, 1_000_000, 132) == 1  # the grid fills the device already
    assert parts(8, 1, 3_000, 132) == 1  # too few keys


def test_rows_without_keys_nan_rows_and_masked_nonfinite_values():
    B, H, L, S, D = 1, 2, 4, 700, 8
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(B, H, L, D, generator=g), torch.randn(B, H, S, D, generator=g), torch.randn(B, H, S, D,
                                                                                                      generator=g)
    q[0, 1, 2] = float("nan")
    v[0, :, 650] = float("inf")  # masked for every query below: must not poison their rows
    mask = torch.ones(L, S, dtype=torch.bool)
    mask[:, 650] = False
    mask[3] = False  # row 3: no key at all
    out, lse = _forward(q, k, v, parts=3, attn_mask=mask)
    assert torch.isnan(out[0, 1, 2]).all() and torch.isnan(lse[0, 1, 2])
    assert (out[:, :, 3] == 0).all() and torch.isneginf(lse[:, :, 3]).all()
    finite = torch.ones(B, H, L, dtype=torch.bool)
    finite[0, 1, 2] = False
    assert torch.isfinite(out[finite]).all()
    whole, whole_lse = _forward(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_merge_of_parts_keeps_empty_rows_and_nan():
    lse = torch.tensor([[0.5, -math.inf, float("nan")], [-math.inf, -math.inf, 1.0]])[:, None, None, :]
    outs = torch.ones(2, 1, 1, 3, 2)
    out, total = torch.empty(1, 1, 3, 2), torch.empty(1, 1, 3)
    triton_split_keys.merge_parts(outs, lse, out, total)
    assert total[0, 0, 0] == 0.5 and (out[0, 0, 0] == 1).all()  # one part holds the row's keys
    assert torch.isneginf(total[0, 0, 1]) and (out[0, 0, 1] == 0).all()  # no part does
    assert torch.isnan(total[0, 0, 2]) and torch.isnan(out[0, 0, 2]).all()  # a NaN part poisons its row
