"""HyperMixer token mixing against a float64 formula of H = W_q GELU(W_kᵀ V) written here from its parameters."""
import doctest
import math

import pytest
import torch

import attn_ext.nn.hypermixer as hypermixer_module
from attn_ext.nn import HyperMixer


def _gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _hypernet(mlp, tokens, head, heads):
    """Head ``head``'s generated weights ``[L, p_h]`` for ``tokens [L, dim]`` (one task), row by row."""
    width = tokens.shape[-1] // heads
    rows = []
    for token in tokens:
        x = token[head * width:(head + 1) * width]
        hidden = x @ mlp.fc1[head].double()
        if mlp.bias1 is not None:
            hidden = hidden + mlp.bias1[head, 0].double()
        out = _gelu(hidden) @ mlp.fc2[head].double()
        if mlp.bias2 is not None:
            out = out + mlp.bias2[head, 0].double()
        rows.append(out)
    return torch.stack(rows) if rows else tokens.new_zeros(0, mlp.fc2.shape[-1])


def reference(mixer, query, key, value, key_padding_mask=None):
    """Per task and head: drop the padded keys, then ``W_q · GELU(W_kᵀ V_h)``; concat heads; LayerNorm."""
    heads, dim = mixer.num_heads, mixer.dim
    width = dim // heads
    out = torch.empty(query.shape[0], query.shape[1], dim, dtype=torch.float64)
    for b in range(query.shape[0]):
        keep = slice(None) if key_padding_mask is None else ~key_padding_mask[b]
        k, v = key[b][keep].double(), value[b][keep].double()
        for h in range(heads):
            w_q = _hypernet(mixer.hyper_query, query[b].double(), h, heads)     # [M, p_h]
            w_k = _hypernet(mixer.hyper_key, k, h, heads)                       # [N, p_h]
            mixed = torch.zeros(w_k.shape[1], width, dtype=torch.float64)
            for j in range(k.shape[0]):                                         # the sum over the keys
                mixed += torch.outer(w_k[j], v[j, h * width:(h + 1) * width])
            out[b, :, h * width:(h + 1) * width] = w_q @ _gelu(mixed)
    if mixer.norm is not None:
        mean = out.mean(-1, keepdim=True)
        var = ((out - mean) ** 2).mean(-1, keepdim=True)
        out = (out - mean) / torch.sqrt(var + mixer.norm.eps) * mixer.norm.weight.double() + mixer.norm.bias.double()
    return out


def _mixer(**kwargs):
    torch.manual_seed(0)
    mixer = HyperMixer(**kwargs)
    with torch.no_grad():  # LayerNorm and biases away from their identity/zero initialisation
        for name, p in mixer.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return mixer


CASES = [dict(dim=6, mixing_dim=9, num_heads=3, hidden_dim=12),
         dict(dim=5, mixing_dim=7, num_heads=1, bias=True),
         dict(dim=8, mixing_dim=4, num_heads=2, layer_norm=False),
         dict(dim=4, mixing_dim=6, num_heads=2, hidden_dim=2, bias=True, layer_norm=False)]


@pytest.mark.parametrize("kwargs", CASES)
@pytest.mark.parametrize("masked", [False, True])
def test_matches_float64_formula(kwargs, masked):
    mixer = _mixer(**kwargs).double()
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 5, kwargs["dim"], generator=g, dtype=torch.float64)
    k = torch.randn(3, 7, kwargs["dim"], generator=g, dtype=torch.float64)
    v = torch.randn(3, 7, kwargs["dim"], generator=g, dtype=torch.float64)
    mask = None
    if masked:
        mask = torch.rand(3, 7, generator=g) < 0.4
        mask[1] = True          # a task whose keys are all padding: the empty sum
        mask[2] = False         # and one with none
    got = mixer(q, k, v, key_padding_mask=mask)
    assert got.shape == q.shape
    assert torch.allclose(got, reference(mixer, q, k, v, mask), atol=1e-12, rtol=1e-10)


def test_float32_matches_formula():
    mixer = _mixer(dim=8, mixing_dim=12, num_heads=4)
    q, kv = torch.randn(2, 6, 8), torch.randn(2, 11, 8)
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[0, 3:] = True
    assert torch.allclose(mixer(q, kv, kv, mask).double(), reference(mixer, q, kv, kv, mask), atol=1e-5)


def test_eq_042_without_layer_norm_and_the_empty_sum():
    # Written out once more with one head and torch's own GELU: H = W_q GELU(W_kᵀ V).
    mixer = _mixer(dim=4, mixing_dim=3, num_heads=1, layer_norm=False).double()
    q, k, v = (torch.randn(1, n, 4, dtype=torch.float64) for n in (2, 5, 5))
    w_q, w_k = mixer.hyper_query(q)[0, 0], mixer.hyper_key(k)[0, 0]
    expected = w_q @ torch.nn.functional.gelu(w_k.T @ v[0])
    assert torch.allclose(mixer(q, k, v)[0], expected, atol=1e-12)
    assert torch.equal(mixer(q, k[:, :0], v[:, :0]), torch.zeros(1, 2, 4, dtype=torch.float64))


def test_padding_is_removed_even_when_it_holds_nan():
    mixer = _mixer(dim=6, mixing_dim=6, num_heads=2)
    q, k, v = torch.randn(2, 4, 6), torch.randn(2, 9, 6), torch.randn(2, 9, 6)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[:, 6:] = True
    k, v = k.clone(), v.clone()
    k[:, 6:], v[:, 6:] = float("nan"), float("inf")
    got = mixer(q, k, v, key_padding_mask=mask)
    assert torch.isfinite(got).all()
    assert torch.allclose(got, mixer(q, k[:, :6], v[:, :6]), atol=1e-6)
    assert not torch.isfinite(mixer(q, k, v)).all()  # without the mask the NaN keys do reach the output


def test_queries_are_independent_and_keys_are_a_set():
    mixer = _mixer(dim=6, mixing_dim=9, num_heads=3).double()
    q, k, v = (torch.randn(2, n, 6, dtype=torch.float64) for n in (5, 8, 8))
    out = mixer(q, k, v)
    q2 = q.clone()
    q2[:, 2] += 1.0
    changed = mixer(q2, k, v)
    others = [0, 1, 3, 4]
    assert torch.allclose(changed[:, others], out[:, others], atol=1e-12)
    assert not torch.allclose(changed[:, 2], out[:, 2])
    perm = torch.randperm(8)
    assert torch.allclose(mixer(q, k[:, perm], v[:, perm]), out, atol=1e-12)
    assert torch.allclose(mixer(q[:, [4, 0, 3, 1, 2]], k, v), out[:, [4, 0, 3, 1, 2]], atol=1e-12)
    v2 = v.clone()
    v2[:, 5] += 1.0
    assert not torch.allclose(mixer(q, k, v2), out)  # every key/value reaches every query


def test_gradcheck():
    mixer = _mixer(dim=4, mixing_dim=6, num_heads=2, bias=True).double()
    q, k, v = (torch.randn(2, n, 4, dtype=torch.float64, requires_grad=True) for n in (3, 5, 5))
    mask = torch.tensor([[False, False, True, False, True], [False] * 5])
    assert torch.autograd.gradcheck(lambda *t: mixer(*t, key_padding_mask=mask), (q, k, v))
    names = ["hyper_key.fc1", "hyper_query.fc2", "hyper_key.bias2", "norm.weight"]
    weights = dict(mixer.named_parameters())

    def of_params(*ps):
        return torch.func.functional_call(mixer, dict(zip(names, ps)), (q, k, v, mask))

    assert torch.autograd.gradcheck(of_params, tuple(weights[n].detach().clone().requires_grad_() for n in names))


def test_memory_is_linear_in_the_number_of_keys():
    from _helpers import peak_allocated_bytes

    mixer = HyperMixer(16, 32, num_heads=2)
    q = torch.randn(1, 64, 16)
    peaks = {}
    for n in (2_000, 8_000):
        kv = torch.randn(1, n, 16)
        with torch.no_grad():
            peaks[n] = peak_allocated_bytes(lambda: mixer(q, kv, kv))
    # An [M, N] score matrix would add 64·N floats; the mixer's peak is a few [N, dim] buffers.
    assert peaks[8_000] <= 4.5 * peaks[2_000], peaks
    assert peaks[8_000] < 8_000 * (16 + 32) * 4 * 4, peaks


@pytest.mark.parametrize("kwargs, match", [
    (dict(dim=6, mixing_dim=8, num_heads=4), "dim=6 must be a positive multiple of num_heads=4"),
    (dict(dim=8, mixing_dim=6, num_heads=4), "mixing_dim=6"),
    (dict(dim=8, mixing_dim=8, num_heads=4, hidden_dim=6), "hidden_dim=6"),
    (dict(dim=8, mixing_dim=8, num_heads=0), "num_heads must be a positive int"),
])
def test_bad_sizes_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HyperMixer(**kwargs)


def test_bad_shapes_raise_naming_them():
    mixer = HyperMixer(8, 8, num_heads=2)
    q, kv = torch.randn(2, 3, 8), torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match=r"HyperMixer: .*query \(2, 3, 7\)"):
        mixer(torch.randn(2, 3, 7), kv, kv)
    with pytest.raises(ValueError, match=r"key \(2, 5\)"):
        mixer(q, kv[..., 0], kv)
    with pytest.raises(ValueError, match=r"batch size"):
        mixer(q, kv[:1], kv[:1])
    with pytest.raises(ValueError, match=r"value \(2, 4, 8\)"):
        mixer(q, kv, kv[:, :4])
    with pytest.raises(ValueError, match=r"key_padding_mask must be a bool tensor \(2, 5\).*\(2, 4\)"):
        mixer(q, kv, kv, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"torch.float32"):
        mixer(q, kv, kv, key_padding_mask=torch.zeros(2, 5))


def test_docstring_examples():
    result = doctest.testmod(hypermixer_module)
    assert result.attempted > 0 and result.failed == 0
