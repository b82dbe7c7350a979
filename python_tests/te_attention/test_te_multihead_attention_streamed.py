"""``ae.nn.te_attention.TEMultiheadAttention`` streams the keys when a call builds no derivative: under
``torch.no_grad()`` it runs the chunked forward of ``attn_ext.ops.te_attention.naive`` (several chunks forced by a
small budget) with the dense formula's result in fp64, NaN and no-key rows included; a differentiated call, a
forward-mode tangent and a ``torch.func`` transform keep the dense formula (whose derivatives they need); and the
streamed call never forms more than its budget of hidden activations."""
from __future__ import annotations

import pytest
import torch
from torch.autograd import forward_ad

import attn_ext.nn.te_attention as te
from attn_ext.nn.te_attention import TEMultiheadAttention
from attn_ext.ops.te_attention import naive

F64 = torch.float64


def _layer_and_inputs(n=13, seed=0):
    torch.manual_seed(seed)
    layer = TEMultiheadAttention(dim=8, num_heads=2, dim_x=2, kernel_hidden=6).double()
    g = torch.Generator().manual_seed(seed + 1)
    return layer, [torch.randn(3, rows, width, generator=g, dtype=F64)
                   for rows, width in ((5, 8), (n, 8), (5, 2), (n, 2))]


@pytest.mark.parametrize("budget", [1, 30, 1 << 22])
@pytest.mark.parametrize("n", [0, 1, 13])
def test_streamed_equals_dense(monkeypatch, budget, n):
    layer, (zq, zk, xq, xk) = _layer_and_inputs(n)
    if n > 2:
        zk[1, 2] = float("nan")  # batch entry 1: NaN rows, as the dense formula gives
    dense = layer(zq, zk, xq, xk)
    monkeypatch.setattr(TEMultiheadAttention, "STREAM_ELEMENTS", budget)
    with torch.no_grad():
        streamed = layer(zq, zk, xq, xk)
    torch.testing.assert_close(streamed, dense.detach(), rtol=1e-12, atol=1e-12, equal_nan=True)
    if n > 2:
        assert torch.isnan(streamed[1]).all() and torch.isfinite(streamed[0]).all()


def test_which_calls_stream(monkeypatch):
    layer, (zq, zk, xq, xk) = _layer_and_inputs()
    calls = []
    monkeypatch.setattr(te, "chunked_forward", lambda *a, **k: calls.append(1) or naive.chunked_forward(*a, **k))
    layer(zq, zk, xq, xk)
    assert calls == [], "a differentiated call keeps the dense formula"
    with torch.no_grad():
        layer(zq, zk, xq, xk)
        assert calls == [1]
        layer(zq, zk, xq, xk, return_weights=True)  # the weights are the dense formula's
        assert calls == [1]
        with forward_ad.dual_level():
            dual = forward_ad.make_dual(zq, torch.ones_like(zq))
            out = layer(dual, zk, xq, xk)
            assert forward_ad.unpack_dual(out).tangent is not None and calls == [1]
        torch.func.vmap(lambda q: layer(q[None], zk[:1], xq[:1], xk[:1]))(zq[:2])
        assert calls == [1], "a torch.func transform keeps the dense formula"
    with torch.inference_mode():
        layer(zq, zk, xq, xk)
    assert calls == [1, 1]


def test_the_streamed_call_holds_its_budget(monkeypatch):
    layer, (zq, zk, xq, xk) = _layer_and_inputs(n=200)
    budget, seen, real = 3 * 5 * 6 * 16, [], naive.ACTIVATIONS["relu"]
    monkeypatch.setattr(TEMultiheadAttention, "STREAM_ELEMENTS", budget)
    monkeypatch.setitem(naive.ACTIVATIONS, "relu", lambda t: seen.append(t.numel()) or real(t))
    with torch.no_grad():
        layer(zq, zk, xq, xk)
    assert seen and max(seen) <= budget < 3 * 5 * 200 * 6


@pytest.mark.parametrize("budget", [1, 1 << 22])
def test_mean_inputs_streamed_and_dense(monkeypatch, budget):
    layer, (zq, zk, xq, xk) = _layer_and_inputs()
    out, mean = layer(zq, zk, xq, xk, return_mean_inputs=True)
    _, weights = layer(zq, zk, xq, xk, return_weights=True)
    torch.testing.assert_close(mean, weights @ xk, rtol=0, atol=0)
    monkeypatch.setattr(TEMultiheadAttention, "STREAM_ELEMENTS", budget)
    with torch.no_grad():
        s_out, s_mean = layer(zq, zk, xq, xk, return_mean_inputs=True)
    torch.testing.assert_close(s_out, out.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s_mean, mean.detach(), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="not both"):
        layer(zq, zk, xq, xk, return_weights=True, return_mean_inputs=True)
