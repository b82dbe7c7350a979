"""attn_ext.nn.MultiheadCrossAttention (MultiheadAttention with batch-first defaults) against
torch.nn.MultiheadAttention on every backend, and the incremental path of both."""
import doctest

import pytest
import torch

import attn_ext as ae
import attn_ext.nn.multihead_cross_attention as mca_module
from attn_ext.nn import MultiheadCrossAttention
from _helpers import ALL_BACKENDS, require_backend

E, H = 32, 4
ATOL = 1e-5


def _pair(**kwargs):
    """A torch MHA (random biases, so they are tested too) and ours with its state dict loaded."""
    reference = torch.nn.MultiheadAttention(E, H, **kwargs)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "bias" in name:
                p.normal_()
    ours = MultiheadCrossAttention(E, H, **kwargs)
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def _padding(B, S, valid):
    """Bool [B, S], True = padding, item b keeping its first valid[b] keys (never zero: torch gives NaN)."""
    return torch.arange(S)[None, :] >= torch.tensor(valid)[:, None]


@pytest.mark.parametrize(
    "kwargs",
    [dict(batch_first=True), dict(batch_first=True, kdim=24, vdim=40), dict(batch_first=False),
     dict(batch_first=False, kdim=8, vdim=16), dict(batch_first=True, bias=False)],
    ids=["same-dim", "kdim-vdim", "seq-first", "seq-first-kdim-vdim", "no-bias"],
)
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "padding"])
def test_matches_torch_forward_and_gradients(kwargs, masked):
    reference, ours = _pair(**kwargs)
    B, L, S = 3, 7, 45
    kdim, vdim = kwargs.get("kdim", E), kwargs.get("vdim", E)
    shape = (lambda n, d: (B, n, d)) if kwargs["batch_first"] else (lambda n, d: (n, B, d))
    q = torch.randn(shape(L, E), requires_grad=True)
    k = torch.randn(shape(S, kdim), requires_grad=True)
    v = torch.randn(shape(S, vdim), requires_grad=True)
    mask = _padding(B, S, [45, 30, 1]) if masked else None

    expected, _ = reference(q, k, v, key_padding_mask=mask, need_weights=False)
    out, weights = ours(q, k, v, key_padding_mask=mask)
    assert weights is None
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=1e-5)

    grad = torch.randn_like(out)
    expected_grads = torch.autograd.grad(expected, [q, k, v, *reference.parameters()], grad)
    grads = torch.autograd.grad(out, [q, k, v, *ours.parameters()], grad)
    names = ["query", "key", "value"] + [n for n, _ in ours.named_parameters()]
    assert names[3:] == [n for n, _ in reference.named_parameters()]
    for name, g, eg in zip(names, grads, expected_grads):
        torch.testing.assert_close(g, eg, atol=1e-4, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("kwargs", [dict(batch_first=True), dict(batch_first=False, kdim=8, vdim=16)],
                         ids=["batch-first", "seq-first-kdim-vdim"])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "padding"])
def test_unbatched_input_matches_torch(kwargs, masked):
    """``[L, E]``, ``[S, kdim]``, ``[S, vdim]`` and a ``[S]`` mask give ``[L, E]``, as in torch (fp64)."""
    reference, ours = _pair(**kwargs, dtype=torch.float64)
    L, S = 6, 11
    g = torch.Generator().manual_seed(3)
    q = torch.randn(L, E, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(S, kwargs.get("kdim", E), generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(S, kwargs.get("vdim", E), generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.arange(S) >= 7 if masked else None
    expected, _ = reference(q, k, v, key_padding_mask=mask, need_weights=False)
    out, weights = ours(q, k, v, key_padding_mask=mask)
    assert weights is None and out.shape == expected.shape == (L, E)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn(L, E, generator=g, dtype=torch.float64)
    for ours_g, torch_g in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)):
        torch.testing.assert_close(ours_g, torch_g, rtol=1e-12, atol=1e-12)
    # The same as a batch of one.
    batched = ours(*(t.unsqueeze(0 if kwargs["batch_first"] else 1) for t in (q, k, v)),
                   key_padding_mask=None if mask is None else mask[None])[0]
    torch.testing.assert_close(out, batched.squeeze(0 if kwargs["batch_first"] else 1), rtol=0, atol=0)


def test_fully_padded_row_is_finite():
    _, ours = _pair(batch_first=True)
    q, kv = torch.randn(2, 3, E, requires_grad=True), torch.randn(2, 6, E)
    out, _ = ours(q, kv, kv, key_padding_mask=_padding(2, 6, [6, 0]))
    assert torch.isfinite(out).all()
    # No attended value: the output is out_proj applied to zeros.
    torch.testing.assert_close(out[1], ours.out_proj.bias.expand(3, E))
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


# ----------------------------------------------------------------------------------------------
# Incremental path
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_first", [True, False])
def test_state_update_remove_query_equal_forward(batch_first):
    _, ours = _pair(batch_first=batch_first, kdim=24, vdim=40)
    B, L = 2, 5
    cat = 1 if batch_first else 0

    def seq(n, d):
        return torch.randn((B, n, d) if batch_first else (n, B, d))

    q = seq(L, E)
    k1, v1, k2, v2, k3, v3 = seq(30, 24), seq(30, 40), seq(12, 24), seq(12, 40), seq(6, 24), seq(6, 40)
    m1, m2, m3 = _padding(B, 30, [30, 21]), _padding(B, 12, [12, 4]), _padding(B, 6, [6, 2])

    state = ours.state(q, k1, v1, m1)
    assert state.out.shape == (B, H, L, E // H) and state.lse.shape == (B, H, L)
    torch.testing.assert_close(ours.query(state), ours(q, k1, v1, key_padding_mask=m1)[0], atol=ATOL, rtol=0)

    state = ours.update(state, q, k2, v2, m2)
    state = ours.update(state, q, k3, v3, m3)
    k, v, m = torch.cat([k1, k2, k3], cat), torch.cat([v1, v2, v3], cat), torch.cat([m1, m2, m3], 1)
    torch.testing.assert_close(ours.query(state), ours(q, k, v, key_padding_mask=m)[0], atol=ATOL, rtol=1e-5)

    # Remove the middle chunk: a small share of the mass, far from the refusal threshold.
    state = ours.remove(state, q, k2, v2, m2)
    k, v, m = torch.cat([k1, k3], cat), torch.cat([v1, v3], cat), torch.cat([m1, m3], 1)
    torch.testing.assert_close(ours.query(state), ours(q, k, v, key_padding_mask=m)[0], atol=1e-4, rtol=1e-4)


def test_empty_state_and_stream_equal_forward():
    _, ours = _pair(batch_first=True)
    q, kv = torch.randn(2, 4, E), torch.randn(2, 50, E)
    mask = _padding(2, 50, [50, 33])
    expected = ours(q, kv, kv, key_padding_mask=mask)[0]
    state = ours.update(ours.empty_state(q), q, kv, kv, mask)
    torch.testing.assert_close(ours.query(state), expected, atol=ATOL, rtol=1e-5)
    chunks = ((kv[:, i:i + 16], kv[:, i:i + 16], mask[:, i:i + 16]) for i in range(0, 50, 16))
    torch.testing.assert_close(ours.query(ours.stream(q, chunks)), expected, atol=ATOL, rtol=1e-5)


def test_incremental_gradients_equal_forward_gradients():
    _, ours = _pair(batch_first=True)
    q = torch.randn(2, 4, E, requires_grad=True)
    kv = torch.randn(2, 40, E, requires_grad=True)
    grad = torch.randn(2, 4, E)
    params = list(ours.parameters())
    expected = torch.autograd.grad(ours(q, kv, kv)[0], [q, kv, *params], grad)
    state = ours.update(ours.state(q, kv[:, :25], kv[:, :25]), q, kv[:, 25:], kv[:, 25:])
    grads = torch.autograd.grad(ours.query(state), [q, kv, *params], grad)
    for g, eg in zip(grads, expected):
        torch.testing.assert_close(g, eg, atol=1e-4, rtol=1e-4)


def test_remove_refuses_when_almost_nothing_remains():
    _, ours = _pair(batch_first=True)
    q, kv = torch.randn(1, 3, E), torch.randn(1, 10, E)
    state = ours.state(q, kv, kv)
    with pytest.raises(ValueError, match="softmax mass"):
        ours.remove(state, q, kv, kv)


# ----------------------------------------------------------------------------------------------
# What the incremental path refuses
# ----------------------------------------------------------------------------------------------


def _inputs():
    return torch.randn(2, 3, E), torch.randn(2, 8, E), torch.randn(2, 8, E)


def test_incremental_path_refuses_what_it_cannot_do():
    reference, ours = _pair(batch_first=True, dropout=0.1)
    q, k, v = _inputs()
    ours(q, k, v)  # forward runs attention dropout in training
    with pytest.raises(NotImplementedError, match=r"no attention dropout; dropout=0.1 in training mode"):
        ours.state(q, k, v)
    ours.eval()
    additive = torch.zeros(2, 8)
    additive[:, 5:] = float("-inf")
    with pytest.raises(TypeError, match=r"takes a bool key_padding_mask.*mask == float\('-inf'\)"):
        ours.state(q, k, v, additive)
    # The suggested conversion gives torch's result for the float mask.
    reference.eval()
    torch.testing.assert_close(ours.query(ours.state(q, k, v, additive == float("-inf"))),
                               reference(q, k, v, key_padding_mask=additive, need_weights=False)[0],
                               atol=ATOL, rtol=1e-5)
    for option in ("add_bias_kv", "add_zero_attn"):
        with pytest.raises(NotImplementedError, match="does not support add_bias_kv or add_zero_attn"):
            MultiheadCrossAttention(E, H, **{option: True}).state(q, k, v)


def test_docstring_examples_run():
    result = doctest.testmod(mca_module, raise_on_error=False)
    assert result.attempted > 0 and result.failed == 0
    import attn_ext.nn as nn_package

    result = doctest.testmod(nn_package, raise_on_error=False)
    assert result.attempted > 0 and result.failed == 0
    assert ae.nn is nn_package


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_every_backend_matches_torch(backend):
    reference, ours = _pair(batch_first=True, kdim=24, vdim=40)
    ours.backend = backend
    q, k, v = torch.randn(2, 5, E), torch.randn(2, 33, 24), torch.randn(2, 33, 40)
    require_backend(backend, q)
    mask = _padding(2, 33, [33, 12])
    torch.testing.assert_close(ours(q, k, v, key_padding_mask=mask)[0],
                               reference(q, k, v, key_padding_mask=mask, need_weights=False)[0], atol=ATOL, rtol=1e-5)


def test_torch_compile_fullgraph_matches_eager():
    _, ours = _pair(batch_first=True)
    q, kv = torch.randn(2, 5, E, requires_grad=True), torch.randn(2, 50, E)
    compiled = torch.compile(ours, fullgraph=True)
    out = compiled(q, kv, kv, key_padding_mask=_padding(2, 50, [50, 20]))[0]
    torch.testing.assert_close(out, ours(q, kv, kv, key_padding_mask=_padding(2, 50, [50, 20]))[0], atol=ATOL, rtol=0)
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
