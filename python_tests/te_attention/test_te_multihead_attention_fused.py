"""``ae.nn.te_attention.TEMultiheadAttention`` runs the fused op ``ae.te_attention`` for every call but
``return_weights``: its output and every gradient equal the plain formula's (its ``return_weights`` path, which
forms the dense logits) in fp64, NaN and no-key rows included; forward mode and ``torch.func`` work through it; its
state dict is the plain formula's; and no call forms a tensor with an ``M·N`` factor."""
from __future__ import annotations

import pytest
import torch
from torch.autograd import forward_ad
from torch.utils._python_dispatch import TorchDispatchMode

from attn_ext.nn.te_attention import TEMultiheadAttention

F64 = torch.float64


def _layer_and_inputs(n=13, seed=0, m=5):
    torch.manual_seed(seed)
    layer = TEMultiheadAttention(dim=8, num_heads=2, dim_x=2, kernel_hidden=6).double()
    g = torch.Generator().manual_seed(seed + 1)
    return layer, [torch.randn(3, rows, width, generator=g, dtype=F64)
                   for rows, width in ((m, 8), (n, 8), (m, 2), (n, 2))]


def _plain(layer, *inputs):
    return layer(*inputs, return_weights=True)[0]


@pytest.mark.parametrize("n", [0, 1, 13])
def test_fused_equals_the_plain_formula(n):
    layer, (zq, zk, xq, xk) = _layer_and_inputs(n)
    if n > 2:
        zk[1, 2] = float("nan")  # batch entry 1: NaN rows, as the plain formula gives
    torch.testing.assert_close(layer(zq, zk, xq, xk), _plain(layer, zq, zk, xq, xk), rtol=1e-12, atol=1e-12,
                               equal_nan=True)


def test_every_gradient_equals_the_plain_formulas():
    layer, inputs = _layer_and_inputs()
    inputs = [t.requires_grad_() for t in inputs]
    grad = torch.randn(3, 5, 8, dtype=F64)
    leaves = [*inputs, *layer.parameters()]
    ours = torch.autograd.grad(layer(*inputs), leaves, grad)
    theirs = torch.autograd.grad(_plain(layer, *inputs), leaves, grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_forward_mode_and_torch_func():
    layer, (zq, zk, xq, xk) = _layer_and_inputs()
    tangent = torch.randn_like(zq)
    with forward_ad.dual_level():
        ours = forward_ad.unpack_dual(layer(forward_ad.make_dual(zq, tangent), zk, xq, xk)).tangent
    _, theirs = torch.func.jvp(lambda q: _plain(layer, q, zk, xq, xk), (zq,), (tangent,))
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    batched = torch.func.vmap(lambda q: layer(q[None], zk[:1], xq[:1], xk[:1])[0])(zq[:2])
    torch.testing.assert_close(batched, layer(zq[:2], *(t[:1].expand(2, -1, -1) for t in (zk, xq, xk))),
                               rtol=1e-12, atol=1e-12)


def test_state_dict_is_the_plain_formulas():
    layer, _ = _layer_and_inputs()
    assert sorted(layer.state_dict()) == ["kernel.0.bias", "kernel.0.weight", "kernel.2.bias", "kernel.2.weight",
                                          "to_k.weight", "to_out.bias", "to_out.weight", "to_q.weight",
                                          "to_v.weight"]


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_size_m_times_n_in_training():
    """Forward and backward of a call with 40 queries and 300 keys: no tensor reaches 40·300 elements (the plain
    formula's hidden layer has 3·40·300·6)."""
    layer, inputs = _layer_and_inputs(n=300, m=40)
    inputs = [t.requires_grad_() for t in inputs]
    with _LargestTensor() as mode:
        layer(*inputs, return_mean_inputs=True)[0].sum().backward()
    assert 0 < mode.largest < 40 * 300


def test_mean_inputs():
    layer, (zq, zk, xq, xk) = _layer_and_inputs()
    out, mean = layer(zq, zk, xq, xk, return_mean_inputs=True)
    plain, weights = layer(zq, zk, xq, xk, return_weights=True)
    torch.testing.assert_close(out, plain, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mean, weights @ xk, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="not both"):
        layer(zq, zk, xq, xk, return_weights=True, return_mean_inputs=True)
