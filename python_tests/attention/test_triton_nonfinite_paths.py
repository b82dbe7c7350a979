"""The Triton kernels' two code paths for calls with per-pair rules (the causal rule, an attention mask): the
common one assumes finite operand rows and multiplies whole tiles; the guarded one reads no non-finite row through
a masked pair (0 · NaN would poison the sum).

Backward: ``backward_route`` picks the guarded kernels exactly when a q or k value is NaN or inf (one host sync,
shared with the saturated-lse check). Forward: no host sync; the first launch marks the rows whose masked pair met
a NaN or inf row of V, and a second, guarded launch recomputes just those rows. Interpreter sizes."""
from __future__ import annotations

import math

import pytest
import torch

from attn_ext.ops.utils.triton import triton_unavailable_reason

pytestmark = pytest.mark.skipif(triton_unavailable_reason("cpu") is not None,
                                reason=f"Triton interpreter unavailable: {triton_unavailable_reason('cpu')}")

B, HQ, HKV, L, S, D = 1, 2, 1, 24, 24, 16
NAN_QUERY = 5  # causal: keys 6.. are above this query's diagonal


def _inputs(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, n, D, generator=gen).to(dtype) for h, n in ((HQ, L), (HKV, S), (HKV, S)))


def _grads(q, k, v, causal=True, attn_mask=None, guard_rows="routed"):
    """``(dq, dk, dv)`` of the Triton backward; ``guard_rows`` "routed": as the op routes the call, None: as
    ``launch_backward`` decides it alone, else forced."""
    from attn_ext.ops.attention.triton_bwd import attention_backward, launch_backward
    from attn_ext.ops.attention.triton_fwd import attention_forward

    args = (attn_mask, None, D ** -0.5, causal, 0.0, torch.tensor([7]), 16)
    out, lse = attention_forward(q, k, v, *args)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    if guard_rows == "routed":
        return attention_backward(grad_out, None, q, k, v, attn_mask, None, out, lse, *args[2:])
    return launch_backward(grad_out, None, q, k, v, None, out, lse, D ** -0.5, 16, attn_mask=attn_mask,
                           is_causal=causal, guard_rows=guard_rows)


@pytest.mark.parametrize("poison", ["none", "nan_q", "inf_k", "huge_q"])
def test_the_route_guards_exactly_the_calls_with_a_non_finite_q_or_k(poison):
    from attn_ext.ops.attention.triton_bwd import backward_route

    q, k, _ = _inputs()
    if poison == "nan_q":
        q[0, 1, 3, 2] = math.nan
    if poison == "inf_k":
        k[0, 0, 9, 0] = -math.inf
    if poison == "huge_q":  # finite, but the check's float32 sum overflows: the guard is taken (exact, slower)
        q[0, 0, :2, 0] = 3e38
    lse = torch.zeros(B, HQ, L)
    assert backward_route(lse, q, k, pair_rules=True) == (False, poison != "none")
    # Without per-pair rules no pair is masked, so nothing needs guarding, whatever the values.
    assert backward_route(lse, q, k, pair_rules=False) == (False, False)
    lse[0, 0, 0] = 600.0  # saturated: the reference backward runs, whatever else holds
    assert backward_route(lse, q, k, pair_rules=True)[0] is True


def test_the_guard_is_what_keeps_a_nan_query_row_out_of_the_keys_above_its_diagonal():
    """The routed call takes the guarded path: a NaN query row reaches only the keys it attends. The same call
    forced down the unguarded path multiplies the NaN row by the zero weights of its masked pairs (the test of
    the route can fail)."""
    q, k, v = _inputs()
    q[0, :, NAN_QUERY, 3] = math.nan
    _, dk, dv = _grads(q, k, v)
    assert torch.isnan(dk[0, 0, :NAN_QUERY + 1]).any(), "the keys the NaN row attends get NaN"
    assert torch.isfinite(dk[0, 0, NAN_QUERY + 1:]).all(), "the keys above its diagonal do not"
    assert torch.isfinite(dv[0, 0, NAN_QUERY + 1:]).all()
    _, dk_forced, _ = _grads(q, k, v, guard_rows=False)
    assert torch.isnan(dk_forced[0, 0, NAN_QUERY + 1:]).any()
    # launch_backward called without the route finds the NaN itself: the routed call's gradients.
    _, dk_alone, dv_alone = _grads(q, k, v, guard_rows=None)
    torch.testing.assert_close(dk_alone, dk, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(dv_alone, dv, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("mask", ["causal", "float", "bool"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_both_paths_give_the_same_gradients_for_finite_inputs(mask, dtype):
    """On finite inputs the guard takes the GEMM in every tile: the two paths are the same arithmetic."""
    q, k, v = _inputs(dtype)
    attn_mask = None
    if mask == "float":
        attn_mask = torch.randn(B, 1, L, S).to(dtype).expand(B, HQ, L, S).clone()
        attn_mask[..., 4] = -math.inf
    if mask == "bool":
        attn_mask = (torch.rand(B, 1, L, S, generator=torch.Generator().manual_seed(2)) > 0.3).expand(B, HQ, L, S)
    causal = mask == "causal"
    routed = _grads(q, k, v, causal, attn_mask)
    guarded = _grads(q, k, v, causal, attn_mask, guard_rows=True)
    for a, b in zip(routed, guarded):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("mask", ["causal", "float"])
def test_the_forward_fix_up_recomputes_exactly_the_marked_rows(mask, monkeypatch):
    """An inf V row behind a masked pair poisons the first launch's rows that mask it (their GEMM reads it with
    weight 0); the fix-up launch recomputes those rows, and only those: the others are the first launch's."""
    from attn_ext.ops.attention import triton_fwd

    q, k, v = _inputs()
    attn_mask = None
    if mask == "float":
        attn_mask = torch.randn(B, 1, L, S).expand(B, HQ, L, S).clone()
        attn_mask[..., :10, 20] = -math.inf  # key 20 masked for the first 10 queries only
        bad_key, masked_rows = 20, slice(0, 10)
    else:
        bad_key, masked_rows = 20, slice(0, 20)  # causal: queries 0..19 do not see key 20
    v[0, 0, bad_key, 1] = math.inf
    args = (attn_mask, None, D ** -0.5, mask == "causal", 0.0, torch.tensor([7]), 16)
    out, lse = triton_fwd.attention_forward(q, k, v, *args)
    assert torch.isfinite(out[:, :, masked_rows]).all(), "the rows that mask the inf key are exact"

    monkeypatch.setattr(triton_fwd, "launch_fixed", lambda *a, **kw: None)
    first, first_lse = triton_fwd.attention_forward(q, k, v, *args)
    assert not torch.isfinite(first[:, :, masked_rows]).all(), "without the fix-up they are poisoned (can fail)"
    marked = ~torch.isfinite(first).all(-1)
    torch.testing.assert_close(out[~marked], first[~marked], rtol=0, atol=0)
    torch.testing.assert_close(lse, first_lse, rtol=0, atol=0)


def test_the_forward_fix_up_costs_one_launch_that_finds_nothing_on_finite_inputs(monkeypatch):
    from attn_ext.ops.attention import triton_fwd

    q, k, v = _inputs()
    args = (None, None, D ** -0.5, True, 0.0, torch.tensor([7]), 16)
    out, lse = triton_fwd.attention_forward(q, k, v, *args)
    monkeypatch.setattr(triton_fwd, "launch_fixed", lambda *a, **kw: None)
    first, first_lse = triton_fwd.attention_forward(q, k, v, *args)
    torch.testing.assert_close(out, first, rtol=0, atol=0)
    torch.testing.assert_close(lse, first_lse, rtol=0, atol=0)
