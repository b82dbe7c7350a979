"""Attention dropout: the counter-based generator (known answers), the keep rate, reproducibility under
``torch.manual_seed``, equality with the dense formula under the same keep mask, and its gradients."""
import math

import pytest
import torch

import attn_ext as ae
from attn_ext.ops.attention.dropout import keep_mask, keep_threshold, philox4x32, philox_words
from _sdpa_ref import backends, dense_attention, require

F64 = torch.float64


def _words(*values):
    return tuple(torch.tensor([v], dtype=torch.int64) for v in values)


def test_philox_known_answers():
    # Random123's known-answer vectors of Philox4x32-10.
    assert [int(w) for w in philox4x32((0, 0), _words(0, 0, 0, 0))] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    ones = 0xFFFFFFFF
    assert [int(w) for w in philox4x32((ones, ones), _words(ones, ones, ones, ones))] == \
        [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    pi = philox4x32((0xA4093822, 0x299F31D0), _words(0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344))
    assert [int(w) for w in pi] == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]
    # 64-bit counters and seeds: the high words feed c1 and k1.
    assert int(philox_words(1 << 32, torch.tensor([1 << 32]))) == int(philox4x32((0, 1), _words(0, 1, 0, 0))[0])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate(p):
    keep = keep_mask(12345, p, (2, 4, 32, 64))
    n = keep.numel()
    rate = keep.double().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(rate - (1 - p)) < 5 * sigma, (rate, 1 - p, sigma)
    # Independent across positions: neighbouring keys agree as often as independence says.
    same = (keep[..., 1:] == keep[..., :-1]).double().mean().item()
    assert abs(same - (p * p + (1 - p) ** 2)) < 6 * math.sqrt(0.25 / keep[..., 1:].numel())


def test_threshold_edges():
    assert keep_threshold(0.0) == 0 and keep_threshold(0.5) == 1 << 31
    assert keep_threshold(math.nextafter(1.0, 0.0)) == (1 << 32) - 1


@pytest.mark.parametrize("backend", backends())
def test_dropout_equals_dense_formula_with_the_same_keep_mask(backend):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 23, 16, generator=g, dtype=F64), torch.randn(2, 2, 41, 16, generator=g, dtype=F64),
               torch.randn(2, 2, 41, 8, generator=g, dtype=F64))
    require(backend, q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = torch.rand(23, 41, generator=g) > 0.2
    torch.manual_seed(7)
    out, lse = ae.scaled_dot_product_attention(*leaves, attn_mask=mask, dropout_p=0.3, enable_gqa=True,
                                               return_lse=True, backend=backend, chunk_size=16)
    torch.manual_seed(7)
    seed = int(torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64))
    keep = keep_mask(seed, 0.3, (2, 4, 23, 41))
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = dense_attention(*ref_leaves, attn_mask=mask, keep=keep, dropout_p=0.3)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)  # lse is of the undropped scores
    grad = torch.randn_like(out)
    for ours, theirs in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(ref, ref_leaves, grad)):
        torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("backend", backends())
def test_reproducible_under_manual_seed(backend):
    q = torch.randn(1, 2, 16, 8, dtype=F64)
    require(backend, q)
    torch.manual_seed(3)
    a = ae.scaled_dot_product_attention(q, q, q, dropout_p=0.5, backend=backend)
    b = ae.scaled_dot_product_attention(q, q, q, dropout_p=0.5, backend=backend)
    torch.manual_seed(3)
    c = ae.scaled_dot_product_attention(q, q, q, dropout_p=0.5, backend=backend)
    assert torch.equal(a, c) and not torch.equal(a, b)
    assert not torch.equal(a, ae.scaled_dot_product_attention(q, q, q, backend=backend))


@pytest.mark.parametrize("backend", backends())
def test_dropout_gradcheck(backend):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=F64, requires_grad=True),
               torch.randn(1, 1, 7, 4, generator=g, dtype=F64, requires_grad=True),
               torch.randn(1, 1, 7, 3, generator=g, dtype=F64, requires_grad=True))
    require(backend, q)

    def fn(q, k, v):
        torch.manual_seed(11)  # the same keep mask at every evaluation
        return ae.scaled_dot_product_attention(q, k, v, dropout_p=0.4, is_causal=True, enable_gqa=True,
                                               backend=backend, chunk_size=3, return_lse=True)

    assert torch.autograd.gradcheck(fn, (q, k, v))
    assert torch.autograd.gradgradcheck(fn, (q, k, v))


def test_mean_output_is_unbiased():
    # E[dropout(P)] = P: averaged over many seeds the output approaches the undropped one.
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 1, 2, 8, generator=g, dtype=F64), torch.randn(1, 1, 16, 8, generator=g, dtype=F64),
               torch.randn(1, 1, 16, 4, generator=g, dtype=F64))
    torch.manual_seed(0)
    runs = torch.stack([ae.scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend="reference") for _ in range(200)])
    full = ae.scaled_dot_product_attention(q, k, v, backend="reference")
    stderr = runs.std(0) / math.sqrt(runs.shape[0])
    assert bool(((runs.mean(0) - full).abs() < 5 * stderr + 1e-12).all())


def test_keep_mask_takes_the_seed_as_a_tensor_and_batched_under_vmap():
    # The composite (higher derivatives, torch.func) reads the seed as a tensor: vmapped with
    # randomness="different" it is one seed per element, which no Python int can stand for.
    seeds = torch.tensor([[3], [(1 << 62) + 12345], [2**63 - 2]], dtype=torch.int64)
    for seed in seeds:
        assert torch.equal(keep_mask(seed, 0.3, (2, 3, 5, 7)), keep_mask(int(seed), 0.3, (2, 3, 5, 7)))
    batched = torch.func.vmap(lambda s: keep_mask(s, 0.3, (2, 3, 5, 7)))(seeds)
    for i, seed in enumerate(seeds):
        assert torch.equal(batched[i], keep_mask(int(seed), 0.3, (2, 3, 5, 7)))
