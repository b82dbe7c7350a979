"""The translation-equivariant attention reference (``attn_ext.ops.te_attention.naive``): the chunked algorithm that
the fused op will run against the dense formula, in fp64: outputs, lse and the gradients of all nine inputs
(through the chunks' recomputed MLPs) for chunk sizes that split the keys unevenly, padded keys, rows with no key,
N = 0, M = 0, odd head dims and asymmetric lengths; the dense formula against ``ae.nn.TEMultiheadAttention``'s
(the model's layer), translation equivariance, and that a chunk's hidden layer is the largest tensor formed."""
from __future__ import annotations

import pytest
import torch

from attn_ext.nn.te_attention import TEMultiheadAttention
from attn_ext.ops.te_attention import naive

F64 = torch.float64


def _problem(B=2, H=3, M=5, N=11, D=7, Dv=4, dx=2, hidden=6, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return dict(q=r(B, H, M, D), k=r(B, H, N, D), v=r(B, H, N, Dv), xq=r(B, M, dx), xk=r(B, N, dx),
                w1=r(hidden, H + dx), b1=r(hidden), w2=r(H, hidden), b2=r(H))


NAMES = ("q", "k", "v", "xq", "xk", "w1", "b1", "w2", "b2")


def _dense_grads(p, mask, grad_out, grad_lse, activation="relu"):
    leaves = {n: p[n].detach().requires_grad_() for n in NAMES}
    out, lse = naive.dense(*(leaves[n] for n in NAMES), key_padding_mask=mask, activation=activation)
    # lse is −inf on rows without keys: their gradient is 0 (nothing to pull back).
    finite = torch.isfinite(lse)
    loss = (out * grad_out).sum() + torch.where(finite, lse * grad_lse, torch.zeros_like(lse)).sum()
    return out.detach(), lse.detach(), torch.autograd.grad(loss, [leaves[n] for n in NAMES], allow_unused=True)


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 64])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_chunked_equals_dense_with_gradients(chunk_size, padded, activation):
    p = _problem()
    mask = None
    if padded:
        mask = torch.rand(2, 11, generator=torch.Generator().manual_seed(1)) < 0.4
        mask[1] = True  # batch entry 1 has no key: out 0, lse −inf, zero gradients
        p["k"][:, :, 3] = float("nan")  # a padded key's NaN must reach nothing
        p["v"][:, :, 3] = float("nan")
        p["xk"][:, 3] = float("nan")
        mask[:, 3] = True
    g = torch.Generator().manual_seed(2)
    grad_out, grad_lse = torch.randn(2, 3, 5, 4, generator=g, dtype=F64), torch.randn(2, 3, 5, generator=g, dtype=F64)
    clean = {n: torch.nan_to_num(t) if n in ("k", "v", "xk") else t for n, t in p.items()}
    want_out, want_lse, want = _dense_grads(clean, mask, grad_out, grad_lse, activation)
    args = [p[n] for n in NAMES]
    out, lse = naive.chunked_forward(*args, key_padding_mask=mask, activation=activation, chunk_size=chunk_size)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    got = naive.chunked_backward(grad_out, grad_lse, *args, mask, out, lse, activation=activation,
                                 chunk_size=chunk_size)
    for name, a, b in zip(NAMES, got, want):
        b = torch.zeros_like(a) if b is None else b
        if padded and name in ("k", "v", "xk"):
            assert torch.all(a[..., 3, :] == 0) if name != "xk" else torch.all(a[:, 3] == 0), name
        torch.testing.assert_close(a, torch.nan_to_num(b), rtol=1e-10, atol=1e-12, msg=name)
    if padded:
        assert torch.all(out[1] == 0) and torch.all(torch.isneginf(lse[1]))


@pytest.mark.parametrize("M, N", [(0, 5), (4, 0), (1, 1), (9, 2)])
def test_sizes_zero_one_and_asymmetric(M, N):
    p = _problem(M=M, N=N, D=5, Dv=3)
    args = [p[n] for n in NAMES]
    out, lse = naive.chunked_forward(*args, chunk_size=2)
    want_out, want_lse = naive.dense(*args)
    assert out.shape == (2, 3, M, 3) and lse.shape == (2, 3, M)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    grads = naive.chunked_backward(torch.ones_like(out), torch.zeros_like(lse), *args, None, out, lse, chunk_size=2)
    assert [tuple(g.shape) for g in grads] == [tuple(t.shape) for t in args]
    assert all(torch.isfinite(g).all() for g in grads)


def test_dense_is_the_layer_of_te_multihead_attention():
    torch.manual_seed(0)
    layer = TEMultiheadAttention(dim=8, num_heads=2, dim_x=2, kernel_hidden=5).double()
    zq, zk, xq, xk = (torch.randn(3, n, w, dtype=F64) for n, w in ((4, 8), (6, 8), (4, 2), (6, 2)))
    b, m, n, h, d = 3, 4, 6, 2, 4
    q = layer.to_q(zq).view(b, m, h, d).transpose(1, 2)
    k = layer.to_k(zk).view(b, n, h, d).transpose(1, 2)
    v = layer.to_v(zk).view(b, n, h, d).transpose(1, 2)
    first, second = layer.kernel[0], layer.kernel[2]
    out, _ = naive.dense(q, k, v, xq, xk, first.weight, first.bias, second.weight, second.bias)
    torch.testing.assert_close(layer.to_out(out.transpose(1, 2).reshape(b, m, h * d)), layer(zq, zk, xq, xk))


def test_translation_equivariance():
    p = _problem(dx=3)
    shift = torch.tensor([1e3, -2.5, 7.0], dtype=F64)
    args = [p[n] for n in NAMES]
    moved = dict(p, xq=p["xq"] + shift, xk=p["xk"] + shift)
    a = naive.chunked_forward(*args, chunk_size=4)
    b = naive.chunked_forward(*[moved[n] for n in NAMES], chunk_size=4)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-9)


def test_a_chunk_is_the_largest_tensor_formed(monkeypatch):
    """Memory: the chunked passes never form a tensor with M·N elements per head (the largest is one chunk's
    hidden layer, [B, M, chunk, hidden])."""
    B, H, M, N, hidden, chunk = 1, 2, 40, 200, 6, 8
    p = _problem(B=B, H=H, M=M, N=N, hidden=hidden)
    largest = []
    real = naive.ACTIVATIONS["relu"]
    monkeypatch.setitem(naive.ACTIVATIONS, "relu", lambda t: largest.append(t.numel()) or real(t))
    args = [p[n] for n in NAMES]
    out, lse = naive.chunked_forward(*args, chunk_size=chunk)
    naive.chunked_backward(torch.ones_like(out), None, *args, None, out, lse, chunk_size=chunk)
    assert max(largest) == B * M * chunk * hidden < M * N
