"""attn_ext.nn.MultiheadAttention beyond the option matrix: state dicts both ways, initialisation,
attention dropout, empty rows, the is_causal rules and the errors."""
import doctest

import pytest
import torch

import attn_ext
import attn_ext.nn.multihead_attention as mha_module
from attn_ext.nn import MultiheadAttention, MultiheadCrossAttention

F64 = torch.float64
E, H = 16, 4
TOL = dict(rtol=1e-10, atol=1e-10)
OPTIONS = [{}, dict(kdim=6, vdim=10), dict(bias=False), dict(add_bias_kv=True), dict(add_zero_attn=True, dropout=0.2)]


@pytest.mark.parametrize("kwargs", OPTIONS, ids=["default", "kdim-vdim", "no-bias", "bias-kv", "zero-attn-dropout"])
def test_same_parameters_initialisation_and_defaults_as_torch(kwargs):
    torch.manual_seed(123)
    reference = torch.nn.MultiheadAttention(E, H, **kwargs)
    torch.manual_seed(123)
    ours = MultiheadAttention(E, H, **kwargs)
    theirs, mine = reference.state_dict(), ours.state_dict()
    assert list(mine) == list(theirs)
    for name in theirs:
        # Same creation and initialisation order as torch, so the same seed gives the same values.
        torch.testing.assert_close(mine[name], theirs[name], atol=0, rtol=0, msg=name)
    assert type(ours.out_proj) is type(reference.out_proj)
    for attribute in ("embed_dim", "kdim", "vdim", "num_heads", "dropout", "batch_first", "head_dim",
                      "_qkv_same_embed_dim", "add_zero_attn"):
        assert getattr(ours, attribute) == getattr(reference, attribute), attribute
    assert (ours.bias_k is None) == (reference.bias_k is None)


@pytest.mark.parametrize("kwargs", OPTIONS[:4], ids=["default", "kdim-vdim", "no-bias", "bias-kv"])
def test_state_dicts_load_both_ways(kwargs):
    x = torch.randn(5, 2, E, dtype=F64)
    kv = torch.randn(7, 2, kwargs.get("kdim", E), dtype=F64), torch.randn(7, 2, kwargs.get("vdim", E), dtype=F64)
    # torch -> ours
    reference = torch.nn.MultiheadAttention(E, H, dtype=F64, **kwargs)
    ours = MultiheadAttention(E, H, dtype=F64, **kwargs)
    ours.load_state_dict(reference.state_dict())
    torch.testing.assert_close(ours(x, *kv)[0], reference(x, *kv)[0], **TOL)
    # ours -> torch
    ours = MultiheadAttention(E, H, dtype=F64, **kwargs)
    reference.load_state_dict(ours.state_dict())
    torch.testing.assert_close(ours(x, *kv)[0], reference(x, *kv)[0], **TOL)


def test_defaults_are_torch_s_and_the_old_name_keeps_its_own():
    ours, alias = MultiheadAttention(E, H), MultiheadCrossAttention(E, H)
    assert ours.batch_first is False and alias.batch_first is True
    x = torch.randn(5, 2, E)
    assert ours(x, x, x)[1].shape == (2, 5, 5)  # need_weights=True by default, as torch
    assert alias(x, x, x)[1] is None  # need_weights=False by default, as before
    assert isinstance(alias, MultiheadAttention)


def test_empty_rows_give_zero_attention_and_finite_gradients():
    """A query with no attended key: torch gives NaN on its slow path; we give out_proj.bias, zero weights,
    no NaN gradient."""
    reference, ours = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=F64), None
    ours = MultiheadAttention(E, H, batch_first=True, dtype=F64)
    with torch.no_grad():
        ours.out_proj.bias.normal_()
    x = torch.randn(2, 4, E, dtype=F64, requires_grad=True)
    banned = torch.zeros(4, 4, dtype=torch.bool)
    banned[2] = True  # query 2 may attend nothing
    padding = torch.tensor([[False] * 4, [True] * 4])  # item 1 has no key at all
    reference.load_state_dict(ours.state_dict())
    for need_weights in (False, True):
        out, weights = ours(x, x, x, attn_mask=banned, key_padding_mask=padding, need_weights=need_weights)
        expected, _ = reference(x, x, x, attn_mask=banned, key_padding_mask=padding, need_weights=need_weights)
        if need_weights:  # torch's slow path gives NaN (its SDPA path, need_weights=False, gives 0 in torch 2.13)
            assert torch.isnan(expected[1]).all() and torch.isnan(expected[0, 2]).all()
        torch.testing.assert_close(out[1], ours.out_proj.bias.expand(4, E), **TOL)
        torch.testing.assert_close(out[0, 2], ours.out_proj.bias, **TOL)
        finite = torch.ones(2, 4, dtype=torch.bool)
        finite[1], finite[0, 2] = False, False
        torch.testing.assert_close(out[finite], expected[finite], **TOL)
        if need_weights:
            assert (weights[1] == 0).all() and (weights[0, 2] == 0).all()
        grad, = torch.autograd.grad(out.sum(), x)
        assert torch.isfinite(grad).all()


def test_is_causal_follows_torch_rules():
    ours = MultiheadAttention(E, H, dtype=F64)
    x = torch.randn(5, 2, E, dtype=F64)
    with pytest.raises(RuntimeError, match="is_causal=True is a hint .* needs attn_mask"):
        ours(x, x, x, is_causal=True, need_weights=False)
    # is_causal is a hint: with need_weights=False and no float padding the mask is trusted and not read,
    # as on torch's own path; with need_weights=True the mask is what counts (torch's rule too).
    reference = torch.nn.MultiheadAttention(E, H, dtype=F64)
    reference.load_state_dict(ours.state_dict())
    not_causal = torch.zeros(5, 5, dtype=torch.bool)
    for need_weights in (False, True):
        got = ours(x, x, x, attn_mask=not_causal, is_causal=True, need_weights=need_weights)[0]
        expected = reference(x, x, x, attn_mask=not_causal, is_causal=True, need_weights=need_weights)[0]
        torch.testing.assert_close(got, expected, **TOL)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5, dtype=F64)
    assert not torch.allclose(ours(x, x, x, attn_mask=not_causal, is_causal=True, need_weights=False)[0],
                              ours(x, x, x, attn_mask=not_causal, need_weights=False)[0])
    torch.testing.assert_close(ours(x, x, x, attn_mask=not_causal, is_causal=True, need_weights=False)[0],
                               ours(x, x, x, attn_mask=causal, need_weights=False)[0], **TOL)


def test_float_padding_of_zeros_and_minus_inf_runs_as_bool_padding(monkeypatch):
    """nn.TransformerEncoder hands its attention a 0/-inf float padding mask: it must still reach the op
    as per-key padding beside the [L, S] mask read in place (with a padding mask torch reads attn_mask and
    leaves the causal hint unused), not as a materialised [B, L, S] additive mask."""
    _, ours = _pair(0.0)
    x = torch.randn(2, 6, E, dtype=F64)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(6, dtype=F64)
    padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    additive = torch.zeros(2, 6, dtype=F64).masked_fill(padding, float("-inf"))
    expected = ours(x, x, x, attn_mask=causal, key_padding_mask=padding, is_causal=True, need_weights=False)[0]
    calls = []
    op = attn_ext.scaled_dot_product_attention
    monkeypatch.setattr(mha_module, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(kw) or op(*a, **kw))
    got = ours(x, x, x, attn_mask=causal, key_padding_mask=additive, is_causal=True, need_weights=False)[0]
    torch.testing.assert_close(got, expected, **TOL)
    assert not calls[0]["is_causal"] and torch.equal(calls[0]["attn_mask"], causal)
    assert torch.equal(calls[0]["key_padding_mask"], padding)
    # Any other value keeps the float mask additive (and the hint unused).
    ours(x, x, x, attn_mask=causal, key_padding_mask=additive.masked_fill(~padding, 0.5), is_causal=True,
         need_weights=False)
    assert calls[1]["key_padding_mask"] is None and calls[1]["attn_mask"].shape == (2, 1, 6, 6)


# ----------------------------------------------------------------------------------------------
# Attention dropout
# ----------------------------------------------------------------------------------------------


def _pair(dropout, **kwargs):
    reference = torch.nn.MultiheadAttention(E, H, dropout=dropout, batch_first=True, dtype=F64, **kwargs)
    ours = MultiheadAttention(E, H, dropout=dropout, batch_first=True, dtype=F64, **kwargs)
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def test_dropout_in_eval_mode_is_off_as_in_torch():
    reference, ours = _pair(0.5)
    reference.eval(), ours.eval()
    x = torch.randn(2, 6, E, dtype=F64)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(6, dtype=F64)
    for call in (dict(need_weights=False), dict(need_weights=False, attn_mask=mask, is_causal=True), {}):
        torch.testing.assert_close(ours(x, x, x, **call)[0], reference(x, x, x, **call)[0], **TOL)


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "causal"])
def test_dropout_in_training_is_reproducible_and_active(masked):
    _, ours = _pair(0.3)
    x = torch.randn(2, 6, E, dtype=F64, requires_grad=True)
    call = dict(need_weights=False)
    if masked:
        call.update(attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(6, dtype=F64), is_causal=True)

    def run(seed):
        torch.manual_seed(seed)
        out = ours(x, x, x, **call)[0]
        return out, torch.autograd.grad(out.square().sum(), [x, ours.in_proj_weight])

    first, again, other = run(1), run(1), run(2)
    torch.testing.assert_close(first[0], again[0], rtol=0, atol=0)
    for a, b in zip(first[1], again[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.allclose(first[0], other[0])
    ours.eval()
    assert not torch.allclose(first[0], ours(x, x, x, **call)[0])


def test_dropout_keep_rate():
    """Values one-hot per key, identity projections and equal scores: each output entry is one pair's
    dropped, rescaled probability, so the fraction of non-zero entries is the keep rate."""
    p, L, S = 0.3, 256, 64
    ours = MultiheadAttention(S, 1, dropout=p, bias=False, batch_first=True, dtype=F64)
    with torch.no_grad():
        ours.in_proj_weight.copy_(torch.eye(S, dtype=F64).repeat(3, 1))
        ours.out_proj.weight.copy_(torch.eye(S, dtype=F64))
    q = torch.zeros(1, L, S, dtype=F64)
    v = torch.eye(S, dtype=F64)[None]
    torch.manual_seed(0)
    out, _ = ours(q, v, v, need_weights=False)
    kept = (out != 0).double().mean().item()
    # L·S = 16384 Bernoulli(0.7) draws: standard deviation 0.0036; five of them allowed.
    assert abs(kept - (1 - p)) < 0.018, kept
    torch.testing.assert_close(out[out != 0], torch.full_like(out[out != 0], 1 / S / (1 - p)))
    assert abs(out.sum().item() / L - 1.0) < 0.03  # rows sum to 1 in expectation (kept mass rescaled)


def test_need_weights_in_training_is_torch_s_slow_path_exactly():
    """With need_weights=True the weights are formed and dropped by torch.nn.functional.dropout, as in
    torch's slow path: under the same seed the result is torch's."""
    reference, ours = _pair(0.4)
    x = torch.randn(2, 6, E, dtype=F64)
    torch.manual_seed(7)
    expected = reference(x, x, x, average_attn_weights=False)
    torch.manual_seed(7)
    got = ours(x, x, x, average_attn_weights=False)
    assert (expected[1] == 0).any()
    torch.testing.assert_close(got[1], expected[1], **TOL)
    torch.testing.assert_close(got[0], expected[0], **TOL)


def test_dropout_of_one_drops_everything():
    reference, ours = _pair(1.0)
    x = torch.randn(2, 6, E, dtype=F64)
    torch.testing.assert_close(ours(x, x, x, need_weights=False)[0], reference(x, x, x, need_weights=False)[0], **TOL)


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, kwargs, error, match", [
    ((torch.randn(5, 2, E + 1), torch.randn(7, 2, E), torch.randn(7, 2, E)), {}, ValueError,
     r"query must be \[L, B, 16\] \(batch_first=False, batched query \(5, 2, 17\)\), got \(5, 2, 17\)"),
    ((torch.randn(1, 5, 2, E), torch.randn(7, 2, E), torch.randn(7, 2, E)), {}, ValueError,
     r"query must be unbatched \[L, E\] or batched 3-D, got \(1, 5, 2, 16\)"),
    ((torch.randn(5, E), torch.randn(1, 7, E), torch.randn(7, E)), {}, ValueError,
     r"key must be \[S, 16\] .*unbatched.*got \(1, 7, 16\)"),
    ((torch.randn(5, 2, E), torch.randn(7, 2, E), torch.randn(6, 2, E)), {}, ValueError,
     r"key \(7, 2, 16\) and value \(6, 2, 16\) must agree"),
    ((torch.randn(5, 2, E), torch.randn(7, 3, E), torch.randn(7, 3, E)), {}, ValueError, "different batch sizes"),
    ((torch.randn(5, 2, E), torch.randn(7, 2, E), torch.randn(7, 2, E)),
     dict(key_padding_mask=torch.zeros(7, 2, dtype=torch.bool)), ValueError,
     r"key_padding_mask must be None or \[2, 7\] .*got \(7, 2\)"),
    ((torch.randn(5, 2, E), torch.randn(7, 2, E), torch.randn(7, 2, E)),
     dict(attn_mask=torch.zeros(7, 5, dtype=torch.bool)), ValueError,
     r"attn_mask must be \[L, S\] = \[5, 7\] or \[B \* num_heads = 8, 5, 7\], got \(7, 5\)"),
    ((torch.randn(5, E), torch.randn(7, E), torch.randn(7, E)),
     dict(attn_mask=torch.zeros(2, 5, 7, dtype=torch.bool)), ValueError, r"\[num_heads = 4, 5, 7\]"),
    ((torch.randn(5, 2, E), torch.randn(7, 2, E), torch.randn(7, 2, E)),
     dict(attn_mask=torch.zeros(5, 7, dtype=torch.int64)), TypeError, "attn_mask must be a bool tensor .*got torch.int64"),
    ((torch.randn(5, 2, E), torch.randn(7, 2, E), torch.randn(7, 2, E)),
     dict(key_padding_mask=torch.zeros(2, 7, dtype=torch.uint8)), TypeError, "key_padding_mask must be a bool"),
])
def test_bad_inputs_are_rejected_with_shapes(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        MultiheadAttention(E, H)(*args, **kwargs)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensors_are_rejected_clearly():
    x = torch.nested.nested_tensor([torch.randn(3, E), torch.randn(5, E)])
    with pytest.raises(ValueError, match="nested tensors are not supported"):
        MultiheadAttention(E, H, batch_first=True)(x, x, x)


def test_bad_construction_arguments():
    with pytest.raises(ValueError, match="divisible"):
        MultiheadAttention(30, 4)
    with pytest.raises(ValueError, match="positive"):
        MultiheadAttention(0, 4)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\]"):
        MultiheadAttention(E, H, dropout=1.5)


def test_docstring_examples_run():
    result = doctest.testmod(mha_module, raise_on_error=False)
    assert result.attempted > 0 and result.failed == 0
