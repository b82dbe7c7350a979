"""The NaN rule and empty rows of the Triton attention op pair: a pair that is not allowed is never read
(NaN or inf in a masked key's k or v row, or in the query row of a masked pair, reaches no result
through that pair), rows without an allowed key give (0, -inf) and zero gradients, and a NaN in an
allowed pair is never silently dropped. Interpreter sizes, as test_sdpa_triton.py."""
from __future__ import annotations

import math

import pytest
import torch

from attn_ext.ops.utils.triton import triton_unavailable_reason
from test_sdpa_triton import SEED, assert_within_flash_rule, dense, dense_grads, keep_mask

pytestmark = pytest.mark.skipif(triton_unavailable_reason("cpu") is not None,
                                reason=f"Triton interpreter unavailable: {triton_unavailable_reason('cpu')}")

B, HQ, HKV, L, S, D = 1, 2, 1, 20, 24, 16
KEY, QUERY = 5, 7  # the masked key (all queries) and the fully masked query row


def _run(q, k, v, mask, kpm, causal, p=0.0, grad_seed=3):
    from attn_ext.ops.attention.triton_bwd import attention_backward
    from attn_ext.ops.attention.triton_fwd import attention_forward

    seed = torch.tensor([SEED])
    out, lse = attention_forward(q, k, v, mask, kpm, D ** -0.5, causal, p, seed, 16)
    gen = torch.Generator().manual_seed(grad_seed)
    grad_out, grad_lse = torch.randn(out.shape, generator=gen).to(out.dtype), torch.randn(lse.shape, generator=gen)
    grads = attention_backward(grad_out, grad_lse, q, k, v, mask, kpm, out, lse, D ** -0.5, causal, p, seed, 16)
    return (out, lse, *grads), (grad_out, grad_lse)


def _masks(kind, dtype):
    """(attn_mask, causal, poisoned key, poisoned query or None) of each way to mask a pair."""
    if kind == "bool":
        mask = torch.ones(1, 1, L, S, dtype=torch.bool)
        mask[..., KEY] = False
        mask[..., QUERY, :] = False
        return mask.expand(B, HQ, L, S), False, KEY, QUERY
    if kind == "float":
        mask = torch.randn(1, HQ, L, S).to(dtype)
        mask[..., KEY] = -math.inf
        mask[..., QUERY, :] = -math.inf
        return mask, False, KEY, QUERY
    if kind == "causal":  # keys L.. are above every query's diagonal (top-left, L < S)
        return None, True, L + 2, None
    raise ValueError(kind)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["bool", "float", "causal"])
def test_masked_pairs_are_never_read(kind, dtype):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, n, D, generator=gen).to(dtype) for h, n in ((HQ, L), (HKV, S), (HKV, S)))
    mask, causal, key, query = _masks(kind, dtype)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[:, -1] = True  # a padded key too: never loaded
    clean, _ = _run(q, k, v, mask, kpm, causal)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    k2[:, :, key] = math.nan
    v2[:, :, key] = math.inf
    k2[:, :, -1], v2[:, :, -1] = math.inf, math.nan
    if query is not None:
        q2[:, :, query] = math.nan
    poisoned, _ = _run(q2, k2, v2, mask, kpm, causal)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), poisoned, clean):
        assert not bool(torch.isnan(a).any()), f"{kind}: NaN in {name}"
        # The poisoned tiles take the exact per-pair sum instead of the GEMM: equal up to rounding.
        torch.testing.assert_close(a, b, msg=f"{kind}: {name} changed by values of masked pairs")
    out, lse, dq, dk, dv = poisoned
    for g in (dk, dv):
        assert bool((g[:, :, key] == 0).all()) and bool((g[:, :, -1] == 0).all())
    if query is not None:
        assert bool((out[:, :, query] == 0).all()) and bool((lse[:, :, query] == -math.inf).all())
        assert bool((dq[:, :, query] == 0).all())


def test_empty_rows_give_zero_out_minus_inf_lse_and_zero_gradients():
    # Batch 0: every key padded; batch 1: bool rows without a key, float rows all -inf, with dropout.
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, HQ, L, D, generator=gen), torch.randn(2, HKV, S, D, generator=gen), \
        torch.randn(2, HKV, S, D, generator=gen)
    kpm = torch.zeros(2, S, dtype=torch.bool)
    kpm[0] = True
    mask = torch.randn(2, HQ, L, S, generator=gen)
    mask[1, :, 3:6] = -math.inf
    mask[1, 0, 10] = -math.inf
    (out, lse, dq, dk, dv), (grad_out, grad_lse) = _run(q, k, v, mask, kpm, False, p=0.3)
    empty = torch.zeros(2, HQ, L, dtype=torch.bool)
    empty[0], empty[1, :, 3:6], empty[1, 0, 10] = True, True, True
    assert bool((out[empty] == 0).all()) and bool((lse[empty] == -math.inf).all())
    assert bool(torch.isfinite(lse[~empty]).all())
    assert bool((dq[empty] == 0).all()) and bool((dk[0] == 0).all()) and bool((dv[0] == 0).all())
    keep = keep_mask(SEED, 0.3, 2, HQ, L, S)
    args = (q, k, v, mask, kpm, D ** -0.5, False, 0.3, keep)
    refs = dense(*args, torch.float64), dense(*args, torch.float32)
    assert_within_flash_rule(out, refs[0][0], refs[1][0], name="out")
    assert_within_flash_rule(lse, refs[0][1], refs[1][1], name="lse")
    ref = dense_grads(*args, grad_out, grad_lse, torch.float64)
    pt = dense_grads(*args, grad_out, grad_lse, torch.float32)
    for name, g, g64, g_pt in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, pt):
        assert_within_flash_rule(g, g64, g_pt, grad=True, name=name)


def test_nan_in_an_allowed_pair_is_not_dropped():
    # Causal: key 3 is allowed for queries 3.. only; those rows (and every key they attend) turn NaN.
    gen = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(B, HQ, L, D, generator=gen), torch.randn(B, HKV, S, D, generator=gen), \
        torch.randn(B, HKV, S, D, generator=gen)
    k[:, :, 3] = math.nan
    (out, lse, dq, dk, dv), _ = _run(q, k, v, None, None, True)
    assert bool(torch.isfinite(out[:, :, :3]).all()) and bool(torch.isfinite(lse[:, :, :3]).all())
    assert bool(torch.isnan(out[:, :, 3:]).all(-1).all()) and bool(torch.isnan(lse[:, :, 3:]).all())
    assert bool(torch.isfinite(dq[:, :, :3]).all()) and bool(torch.isnan(dq[:, :, 3:]).any(-1).all())
    assert bool(torch.isnan(dk[:, :, :L]).any(-1).all())
    assert bool((dk[:, :, L:] == 0).all()) and bool((dv[:, :, L:] == 0).all())  # keys no query attends
