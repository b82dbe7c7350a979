"""The Hopper TMA backward (``attn_ext/ops/attention/triton_bwd_tma.py``, opt-in with the TMA forward by
``ATTN_EXT_TRITON_TMA=1``) in the Triton interpreter: its gradients against fp64 autograd of the dense formula
with FlashAttention's rule (3x for gradients), ``grad_lse`` folded in, the general backward's conventions at the
edges (empty rows, NaN rows, non-finite rows above the diagonal), the reasons it gives, and that the
backward's dispatch takes it exactly when enabled and the call qualifies.

As for the TMA forward, the interpreter multiplies in fp32 (``UPCAST``): these tests prove the descriptors'
boxes, the zero-filled tails, the loop split and the GQA sums; the machine code is checked ahead of time
(``bench/gpu/triton_aot.py``).
"""
from __future__ import annotations


import pytest
import torch

from _helpers import assert_within_flash_rule
from attn_ext.ops.utils.triton import triton_unavailable_reason

pytestmark = pytest.mark.skipif(triton_unavailable_reason("cpu") is not None,
                                reason=f"Triton interpreter unavailable: {triton_unavailable_reason('cpu')}")

if triton_unavailable_reason("cpu") is None:
    from test_sdpa_triton import dense_grads, flash_formula_grads

    from attn_ext.ops.attention import triton_bwd, triton_bwd_tma, triton_fwd, triton_fwd_tma

# id: (B, Hq, Hkv, M, N, D, Dv, causal, dtype): tails in M and N, M < N and M > N under the causal rule,
# grouped heads (the dK/dV program's group sum), a head dim padded to the tile (40 -> 64).
CASES = {
    "plain-tails-fp16": (2, 2, 2, 45, 57, 16, 16, False, torch.float16),
    "gqa-D40-bf16": (1, 4, 2, 33, 70, 40, 24, False, torch.bfloat16),
    "causal-M<N-gqa-bf16": (1, 4, 2, 37, 90, 32, 16, True, torch.bfloat16),
    "causal-M>N-fp16": (2, 2, 2, 75, 40, 16, 24, True, torch.float16),
    "causal-M=N-bf16": (1, 2, 1, 100, 100, 16, 16, True, torch.bfloat16),
}


@pytest.fixture
def tma_on(monkeypatch):
    monkeypatch.setenv(triton_fwd_tma.TMA_ENV, "1")


@pytest.fixture
def tma_bwd_calls(monkeypatch):
    """The TMA backward launches that ``launch_backward`` makes (each still runs)."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(args)
        return triton_bwd_tma.launch_backward_tma(*args, **kwargs)

    monkeypatch.setattr(triton_bwd, "launch_backward_tma", spy)
    return calls


def _problem(name, seed=0):
    B, Hq, Hkv, M, N, D, Dv, causal, dtype = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, Hq, M, D, generator=gen), torch.randn(B, Hkv, N, D, generator=gen)
    v = torch.randn(B, Hkv, N, Dv, generator=gen)
    grad_out = torch.randn(B, Hq, M, Dv, generator=gen)
    grad_lse = torch.randn(B, Hq, M, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), grad_out.to(dtype), grad_lse, causal


def _grads(q, k, v, grad_out, grad_lse, causal, chunk_size=64):
    scale = q.shape[-1] ** -0.5
    out, lse = triton_fwd.attention_forward(q, k, v, None, None, scale, causal, 0.0, None, chunk_size)
    return triton_bwd.attention_backward(grad_out, grad_lse, q, k, v, None, None, out, lse, scale, causal, 0.0,
                                         None, chunk_size)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("name", list(CASES))
def test_gradients_match_fp64_within_the_flash_rule(name, chunk_size, tma_on, tma_bwd_calls):
    q, k, v, grad_out, grad_lse, causal = _problem(name)
    assert triton_bwd_tma.tma_backward_unavailable_reason(grad_out, q, k, v) is None
    ours = _grads(q, k, v, grad_out, grad_lse, causal, chunk_size)
    assert len(tma_bwd_calls) == 1
    scale = q.shape[-1] ** -0.5
    ref = dense_grads(q, k, v, None, None, scale, causal, 0.0, None, grad_out, grad_lse, torch.float64)
    same = dense_grads(q, k, v, None, None, scale, causal, 0.0, None, grad_out, grad_lse, q.dtype)
    formula = flash_formula_grads(q, k, v, None, None, scale, causal, 0.0, None, grad_out, grad_lse.to(q.dtype))
    for label, g, g64, g_pt, g_fa in zip("qkv", ours, ref, same, formula):
        assert g.dtype == q.dtype and g.shape == g64.shape
        worse = torch.where((g_pt.double() - g64).abs() >= (g_fa.double() - g64).abs(), g_pt.double(), g_fa.double())
        assert_within_flash_rule(g, g64, worse, grad=True, name=f"{name} d{label}")


def test_the_same_gradients_as_the_general_backward(monkeypatch, tma_bwd_calls):
    q, k, v, grad_out, grad_lse, causal = _problem("causal-M<N-gqa-bf16")
    results = {}
    for enabled in ("0", "1"):
        monkeypatch.setenv(triton_fwd_tma.TMA_ENV, enabled)
        results[enabled] = _grads(q, k, v, grad_out, grad_lse, causal, 32)
    assert len(tma_bwd_calls) == 1
    for general, tma in zip(results["0"], results["1"]):
        torch.testing.assert_close(tma.float(), general.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_a_nan_query_row_spreads_only_where_the_pairs_reach(causal, tma_on, tma_bwd_calls):
    q, k, v, grad_out, grad_lse, _ = _problem("causal-M=N-bf16")
    q[0, 1, 50, 3] = float("nan")
    dq, dk, dv = _grads(q, k, v, grad_out, grad_lse, causal)
    assert len(tma_bwd_calls) == 1
    assert torch.isnan(dq[0, 1, 50]).all()
    others = torch.ones(dq.shape[:3], dtype=torch.bool)
    others[0, 1, 50] = False
    if causal:
        # Query 50 sees keys 0..50 only: keys 51.. (in the block the diagonal crosses, then beyond) keep finite
        # gradients, read through the exact product where the NaN row meets a masked pair.
        assert torch.isfinite(dk[0, 0, 51:]).all() and torch.isfinite(dv[0, 0, 51:]).all()
        assert torch.isnan(dk[0, 0, :51]).any()
    assert torch.isfinite(dq[others]).all()


def test_empty_rows_give_zero_gradients(tma_on, tma_bwd_calls):
    # q[5] = (inf, 0, ...) against keys whose first entry is negative: every score is -inf, no key has weight.
    q, k, v, grad_out, grad_lse, _ = _problem("plain-tails-fp16")
    q[:, :, 5] = 0.0
    q[:, :, 5, 0] = float("inf")
    k[..., 0] = -k[..., 0].abs() - 0.5
    dq, dk, dv = _grads(q, k, v, grad_out, grad_lse, False)
    assert len(tma_bwd_calls) == 1
    assert torch.equal(dq[:, :, 5], torch.zeros_like(dq[:, :, 5]))
    assert torch.isfinite(dv).all() and torch.isfinite(dq[:, :, 6:]).all()


def test_an_inf_key_row_above_the_diagonal_stays_there(tma_on, tma_bwd_calls):
    # Key 90 is inf: queries 90.. see it (their scores are inf or NaN); dQ of the earlier rows must not read it
    # through a masked pair's zero weight (0 * inf = NaN).
    q, k, v, grad_out, grad_lse, _ = _problem("causal-M=N-bf16")
    k[:, :, 90] = float("inf")
    dq, _, _ = _grads(q, k, v, grad_out, grad_lse, True, 16)
    assert len(tma_bwd_calls) == 1
    assert torch.isfinite(dq[:, :, :90]).all()
    k[:, :, 90] = 0.0
    scale = q.shape[-1] ** -0.5
    ref = dense_grads(q, k, v, None, None, scale, True, 0.0, None, grad_out, grad_lse, torch.float64)[0]
    torch.testing.assert_close(dq[:, :, :90].double(), ref[:, :, :90], rtol=3e-2, atol=3e-2)


def test_each_refused_condition_has_its_reason(monkeypatch):
    reason = triton_bwd_tma.tma_backward_unavailable_reason
    q, k, v, grad_out, _, _ = _problem("gqa-D40-bf16")
    monkeypatch.delenv(triton_fwd_tma.TMA_ENV, raising=False)
    assert "ATTN_EXT_TRITON_TMA=1" in reason(grad_out, q, k, v)
    monkeypatch.setenv(triton_fwd_tma.TMA_ENV, "1")
    assert reason(grad_out, q, k, v) is None
    refused = {
        "TMA backward has none": reason(grad_out, q, k, v, dropout_p=0.1),
        "grad_out is torch.float32": reason(grad_out.float(), q, k, v),
        "grad_out is not a TMA source": reason(grad_out.transpose(2, 3).contiguous().transpose(2, 3), q, k, v),
        "multiple of 16 bytes": reason(grad_out, *(t.as_strided((t.shape[0], t.shape[1], t.shape[2], 4),
                                                                (t.shape[1] * t.shape[2] * 8, t.shape[2] * 8, 8, 1))
                                                   for t in (q, k)), v),
    }
    for expected, why in refused.items():
        assert why is not None and expected in why, (expected, why)


def test_dispatch_takes_the_tma_backward_only_when_enabled_and_the_call_qualifies(monkeypatch, tma_bwd_calls):
    q, k, v, grad_out, grad_lse, _ = _problem("plain-tails-fp16")
    monkeypatch.delenv(triton_fwd_tma.TMA_ENV, raising=False)
    _grads(q, k, v, grad_out, grad_lse, False)
    assert tma_bwd_calls == []
    monkeypatch.setenv(triton_fwd_tma.TMA_ENV, "1")
    scale = q.shape[-1] ** -0.5
    kpm = torch.zeros(q.shape[0], k.shape[2], dtype=torch.bool)
    out, lse = triton_fwd.attention_forward(q, k, v, None, kpm, scale, False, 0.0, None, 64)
    triton_bwd.attention_backward(grad_out, grad_lse, q, k, v, None, kpm, out, lse, scale, False, 0.0, None, 64)
    assert tma_bwd_calls == []  # a key padding mask: the general kernels
    triton_bwd.cross_attention_backward(grad_out, grad_lse, q, k, v, None, out, lse, scale, 64)
    assert len(tma_bwd_calls) == 1  # cross attention shares the dispatch
