"""attn_ext.nn.CMAB: forward against plain torch, and update/remove equal a fresh forward (docs/spec.md §2)."""
import doctest

import pytest
import torch

import attn_ext.nn.cmab as cmab_module
from attn_ext.nn import CMAB, CMABState, OfficialPerceiverBlock, PerceiverBlock, PreNormBlock

DIM, LATENTS, HEADS, FF = 32, 16, 4, 64
TOL = dict(atol=1e-5, rtol=1e-4)


@pytest.fixture(params=[PreNormBlock, PerceiverBlock, OfficialPerceiverBlock], ids=["prenorm", "perceiver", "official"])
def block(request):
    torch.manual_seed(1)
    module = CMAB(DIM, LATENTS, HEADS, FF, block=request.param)
    with torch.no_grad():
        # Random norms and biases, so that a mix-up of any of them shows.
        for name, p in module.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.3 * torch.randn_like(p))
            if name == "latents":
                p.normal_()
    return module


def _padding(S, valid):
    return torch.arange(S)[None, :] >= torch.tensor(valid)[:, None]


def _torch_block(block, x, context=None, mask=None):
    """One block computed with torch.nn.MultiheadAttention loaded with the block's weights: pre-norm
    (residual x), or Perceiver (residuals LN(x) and LN''(h))."""
    mha = torch.nn.MultiheadAttention(DIM, HEADS, batch_first=True)
    weights = dict(block.attention.state_dict())
    if block.attention.in_proj_bias is None:  # OfficialPerceiverBlock: bias-free q/k/v projections
        weights["in_proj_bias"] = torch.zeros(3 * DIM)
    mha.load_state_dict(weights)
    q = block.norm_query(x)
    c = q if block.norm_context is None else block.norm_context(context)
    attended = mha(q, c, c, key_padding_mask=mask, need_weights=False)[0]
    if isinstance(block, PerceiverBlock):
        h = block.norm_ff(q + attended)
        return h + block.ff(h)
    h = x + attended
    return h + block.ff(block.norm_ff(h))


def _torch_cmab(block, latents, context, mask=None):
    lb = block.latents.expand(context.shape[0], -1, -1)
    compressed = _torch_block(block.latent_self, _torch_block(block.compress, lb, context, mask))
    return _torch_block(block.output_self, _torch_block(block.cross, latents, compressed))


def test_forward_matches_plain_torch_composition(block):
    latents, context = torch.randn(3, 10, DIM), torch.randn(3, 50, DIM)
    mask = _padding(50, [50, 37, 5])
    out = block(latents, context, mask)
    assert out.shape == (3, 10, DIM)
    torch.testing.assert_close(out, _torch_cmab(block, latents, context, mask), **TOL)


def test_update_equals_forward_on_union(block):
    latents, d1, d2, d3 = torch.randn(2, 8, DIM), torch.randn(2, 40, DIM), torch.randn(2, 9, DIM), torch.randn(2, 1, DIM)
    state = block.update(block.update(block.init_state(d1), d2), d3)
    expected = block(latents, torch.cat([d1, d2, d3], 1))
    torch.testing.assert_close(block.output(state, latents), expected, **TOL)


def test_remove_equals_forward_on_rest(block):
    latents, d1, d2 = torch.randn(2, 8, DIM), torch.randn(2, 60, DIM), torch.randn(2, 6, DIM)
    state = block.remove(block.init_state(torch.cat([d1, d2], 1)), d2)
    torch.testing.assert_close(block.output(state, latents), block(latents, d1), **TOL)
    # Update then remove returns to the earlier result.
    state = block.remove(block.update(block.init_state(d1), d2), d2)
    torch.testing.assert_close(block.output(state, latents), block(latents, d1), **TOL)


def test_remove_refuses_to_empty_the_context(block):
    context = torch.randn(1, 5, DIM)
    with pytest.raises(ValueError, match="softmax mass"):
        block.remove(block.init_state(context), context)


def test_masks_equal_unpadded_contexts(block):
    latents = torch.randn(2, 8, DIM)
    d1, d2 = torch.randn(2, 30, DIM), torch.randn(2, 10, DIM)
    m1, m2 = _padding(30, [30, 17]), _padding(10, [3, 10])
    state = block.update(block.init_state(d1, m1), d2, m2)
    out = block.output(state, latents)
    torch.testing.assert_close(out, block(latents, torch.cat([d1, d2], 1), torch.cat([m1, m2], 1)), **TOL)
    # Padding is ignored: each item equals the block on its valid points alone.
    for b, (n1, n2) in enumerate([(30, 3), (17, 10)]):
        alone = block(latents[b:b + 1], torch.cat([d1[b:b + 1, :n1], d2[b:b + 1, :n2]], 1))
        torch.testing.assert_close(out[b:b + 1], alone, **TOL)
    # Removing with a mask removes only the valid points.
    state = block.remove(state, d2, m2)
    torch.testing.assert_close(block.output(state, latents), block(latents, d1, m1), **TOL)


def test_chunked_init_state_equals_one_shot(block):
    latents, context = torch.randn(2, 8, DIM), torch.randn(2, 101, DIM)
    mask = _padding(101, [101, 64])
    one_shot = block.init_state(context, mask)
    chunked = block.init_state(context, mask, chunk_size=16)
    torch.testing.assert_close(chunked.attention.out, one_shot.attention.out, **TOL)
    torch.testing.assert_close(chunked.attention.lse, one_shot.attention.lse, **TOL)
    torch.testing.assert_close(block.output(chunked, latents), block.output(one_shot, latents), **TOL)
    with pytest.raises(ValueError, match="chunk_size"):
        block.init_state(context, chunk_size=0)
    empty = block.init_state(context[:, :0], chunk_size=16)
    assert torch.isinf(empty.attention.lse).all()


def test_state_size_is_independent_of_context_size(block):
    shapes = set()
    for n in (1, 10, 1000):
        state = block.init_state(torch.randn(2, n, DIM))
        assert isinstance(state, CMABState)
        shapes.add(tuple((name, tuple(t.shape)) for name, t in state.attention._asdict().items()))
    assert shapes == {(("out", (2, HEADS, LATENTS, DIM // HEADS)), ("lse", (2, HEADS, LATENTS)))}


def test_gradients_reach_parameters_and_context(block):
    latents = torch.randn(2, 8, DIM, requires_grad=True)
    context = torch.randn(2, 30, DIM, requires_grad=True)
    block(latents, context, _padding(30, [30, 20])).square().sum().backward()
    for name, p in block.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    assert context.grad[1, 20:].abs().max() == 0  # padding gets no gradient
    assert context.grad[:, :20].abs().sum() > 0 and latents.grad.abs().sum() > 0


def test_gradients_through_update_equal_forward_gradients(block):
    latents = torch.randn(2, 8, DIM, requires_grad=True)
    context = torch.randn(2, 30, DIM, requires_grad=True)
    inputs = [latents, context, *block.parameters()]
    grad = torch.randn(2, 8, DIM)
    expected = torch.autograd.grad(block(latents, context), inputs, grad)
    state = block.update(block.init_state(context[:, :22]), context[:, 22:])
    grads = torch.autograd.grad(block.output(state, latents), inputs, grad)
    for g, eg in zip(grads, expected):
        torch.testing.assert_close(g, eg, atol=1e-4, rtol=1e-4)


def test_shared_latents_broadcast_over_batch(block):
    latents, context = torch.randn(8, DIM), torch.randn(3, 20, DIM)
    torch.testing.assert_close(block(latents, context), block(latents.expand(3, -1, -1), context), **TOL)


def test_bad_inputs_raise(block):
    with pytest.raises(ValueError, match=r"context must be \[B, N, 32\]"):
        block(torch.randn(2, 8, DIM), torch.randn(2, 20, DIM + 1))
    with pytest.raises(TypeError, match="bool"):
        block(torch.randn(2, 8, DIM), torch.randn(2, 20, DIM), torch.zeros(2, 20))
    with pytest.raises(ValueError, match=r"latents must be \[2, L_I, 32\]"):
        block(torch.randn(3, 8, DIM), torch.randn(2, 20, DIM))


def test_docstring_examples_run():
    result = doctest.testmod(cmab_module, raise_on_error=False)
    assert result.attempted > 0 and result.failed == 0


def test_prenorm_block_cross_needs_a_context():
    block = PreNormBlock(dim=8, num_heads=2, ff_dim=16, cross=True)
    with pytest.raises(ValueError, match="needs a context"):
        block(torch.randn(1, 3, 8))
