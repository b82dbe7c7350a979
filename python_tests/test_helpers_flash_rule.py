"""The test oracle itself: naive attention and the FlashAttention error rule must be able to fail."""
import math

import pytest
import torch

from _helpers import assert_within_flash_rule, make_mask, naive_attention, naive_grads


def _case(dtype=torch.float16):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 9, 16, generator=gen).to(dtype) for _ in range(3))
    mask = make_mask("all_padded", 2, 9)
    out64, lse64 = naive_attention(q.double(), k.double(), v.double(), mask)
    out_pt, lse_pt = naive_attention(q, k, v, mask)
    return q, k, v, mask, out64, lse64, out_pt, lse_pt


def test_naive_attention_matches_sdpa():
    q, k, v = (torch.randn(2, 3, 7, 8, dtype=torch.float64) for _ in range(3))
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[1, :3] = True
    out, lse = naive_attention(q, k, v, mask)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=~mask[:, None, None, :])
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    torch.testing.assert_close(lse, torch.logsumexp(scores.masked_fill(mask[:, None, None], -math.inf), -1))


def test_naive_attention_fully_padded_rows_are_zero_and_grads_finite():
    q, k, v = (torch.randn(2, 1, 3, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.tensor([[True, True, True], [False, True, False]])
    out, lse = naive_attention(q, k, v, mask)
    assert bool((out[0] == 0).all()) and bool((lse[0] == -math.inf).all())
    torch.autograd.grad((out, lse), (q, k, v), (torch.randn_like(out), torch.randn_like(lse)))
    gq, gk, gv = naive_grads(q, k, v, mask, None, torch.randn_like(out), torch.randn_like(lse))
    for g in (gq, gk, gv):
        assert bool(torch.isfinite(g).all())
    assert bool((gq[0] == 0).all()) and bool((gk[0] == 0).all()) and bool((gv[0] == 0).all())
    assert bool((gk[1, :, 1] == 0).all()) and bool((gv[1, :, 1] == 0).all())


def test_flash_rule_accepts_the_same_precision_result():
    *_, out64, lse64, out_pt, lse_pt = _case()
    assert_within_flash_rule(out_pt, out64, out_pt, name="out")
    assert_within_flash_rule(lse_pt, lse64, lse_pt, name="lse")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_flash_rule_rejects_a_perturbed_result(dtype):
    *_, out64, _, out_pt, _ = _case(dtype)
    err_pt = float((out_pt.double() - out64).abs().max())
    bad = out_pt.clone()
    bad[1, 0, 4, 3] += 3 * err_pt + 4 * torch.finfo(dtype).eps * max(1.0, float(out64.abs().max()))
    with pytest.raises(AssertionError, match=r"out: max\|ours - ref\| = .* exceeds 2 \* max\|pytorch - ref\|"):
        assert_within_flash_rule(bad, out64, out_pt, name="out")
    # The gradient variant allows 3x, and rejects beyond it.
    bad[1, 0, 4, 3] += err_pt
    with pytest.raises(AssertionError, match="exceeds 3"):
        assert_within_flash_rule(bad, out64, out_pt, grad=True, name="out")


def test_flash_rule_rejects_nan_and_wrong_infinities():
    *_, out64, lse64, out_pt, lse_pt = _case()
    bad = out_pt.clone()
    bad[1, 1, 0, 0] = float("nan")
    with pytest.raises(AssertionError, match="NaN"):
        assert_within_flash_rule(bad, out64, out_pt)
    bad_lse = lse_pt.float().clone()
    bad_lse[0, 0, 0] = 0.0  # fully padded entry must be -inf
    with pytest.raises(AssertionError, match="infinite expected entries"):
        assert_within_flash_rule(bad_lse, lse64, lse_pt)
    bad_lse = lse_pt.float().clone()
    bad_lse[1, 0, 0] = -math.inf  # a row with keys must be finite
    with pytest.raises(AssertionError, match="non-finite"):
        assert_within_flash_rule(bad_lse, lse64, lse_pt)


def test_flash_rule_rejects_wrong_shape():
    *_, out64, _, out_pt, _ = _case()
    with pytest.raises(AssertionError, match="shape"):
        assert_within_flash_rule(out_pt[:, :, :-1], out64, out_pt)
