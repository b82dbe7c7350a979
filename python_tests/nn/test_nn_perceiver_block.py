"""PerceiverBlock (the official LBANP code's block) against its formula in float64 PyTorch."""
import pytest
import torch
import torch.nn.functional as F

from attn_ext.nn import OfficialPerceiverBlock, PerceiverBlock, PreNormBlock

DIM, HEADS, FF = 24, 3, 40


def _attention(mha, q, c):
    """Multi-head attention with ``mha``'s weights, on PyTorch's own ops."""
    w_q, w_k, w_v = mha.in_proj_weight.chunk(3)
    b_q, b_k, b_v = (None,) * 3 if mha.in_proj_bias is None else mha.in_proj_bias.chunk(3)

    def heads(t):
        return t.unflatten(-1, (HEADS, DIM // HEADS)).transpose(1, 2)

    out = F.scaled_dot_product_attention(heads(F.linear(q, w_q, b_q)), heads(F.linear(c, w_k, b_k)),
                                         heads(F.linear(c, w_v, b_v)))
    return mha.out_proj(out.transpose(1, 2).flatten(-2))


def _formula(block, x, context):
    q = block.norm_query(x)
    c = q if context is None else block.norm_context(context)
    h = block.norm_ff(q + _attention(block.attention, q, c))
    hidden, gate = block.ff[0](h).chunk(2, dim=-1)
    return h + block.ff[2](hidden * F.gelu(gate))


@pytest.mark.parametrize("Block", [PerceiverBlock, OfficialPerceiverBlock])
@pytest.mark.parametrize("cross", [True, False])
def test_matches_its_formula_in_float64(cross, Block):
    torch.manual_seed(0)
    block = Block(DIM, HEADS, FF, cross=cross).double()
    for p in block.parameters():  # LayerNorm and bias start at 1 and 0: move them so the test sees them.
        p.data.add_(0.1 * torch.randn_like(p))
    x = 3 * torch.randn(2, 7, DIM, dtype=torch.float64) + 1
    context = torch.randn(2, 19, DIM, dtype=torch.float64) if cross else None
    torch.testing.assert_close(block(x, context), _formula(block, x, context), rtol=1e-10, atol=1e-10)


def test_the_residual_is_the_normalised_input():
    # Shifting and scaling a token leaves the block's output unchanged (PreNormBlock's is not):
    # every residual starts from LN(x), not from x.
    torch.manual_seed(1)
    x, context = torch.randn(2, 5, DIM), torch.randn(2, 9, DIM)
    block, prenorm = PerceiverBlock(DIM, HEADS, FF, cross=True), PreNormBlock(DIM, HEADS, FF, cross=True)
    torch.testing.assert_close(block(4 * x + 2, context), block(x, context), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(prenorm(4 * x + 2, context), prenorm(x, context), atol=1e-2)


def test_feed_forward_is_a_geglu_of_twice_the_width():
    block = PerceiverBlock(DIM, HEADS, FF, cross=False)
    assert block.ff[0].out_features == 2 * FF and block.ff[2].in_features == FF


def test_padding_mask_drops_keys():
    torch.manual_seed(2)
    block = PerceiverBlock(DIM, HEADS, FF, cross=True)
    x, context = torch.randn(2, 4, DIM), torch.randn(2, 10, DIM)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[:, 6:] = True
    torch.testing.assert_close(block(x, context, mask), block(x, context[:, :6]), rtol=1e-5, atol=1e-5)


def test_cross_needs_a_context():
    with pytest.raises(ValueError, match="needs a context"):
        PerceiverBlock(8, 2, 16, cross=True)(torch.randn(1, 3, 8))


def test_official_projections_are_bias_free_linear_layers():
    # The official Attention: to_q and to_kv are nn.Linear(bias=False), to_out nn.Linear; all start
    # uniform in ±1/sqrt(fan_in). MultiheadCrossAttention's own start is Xavier (wider) with zero biases.
    torch.manual_seed(3)
    dim = 64
    official = OfficialPerceiverBlock(dim, 4, FF, cross=True).attention
    names = {name for name, _ in official.named_parameters()}
    assert "in_proj_bias" not in names and "out_proj.bias" in names
    bound = dim ** -0.5
    for weight in (official.in_proj_weight, official.out_proj.weight, official.out_proj.bias):
        assert weight.abs().max() <= bound
        assert weight.abs().max() > 0.8 * bound  # uniform over the whole range, not a narrower draw
    assert official.out_proj.bias.abs().min() > 0
    xavier = PerceiverBlock(dim, 4, FF, cross=True).attention.in_proj_weight
    assert xavier.abs().max() > 1.1 * bound
