"""The ``is_causal`` hint of attn_ext.nn.MultiheadAttention follows torch 2.13's rule exactly.

torch's ``F.multi_head_attention_forward`` (every call but its inference fast path): with
``is_causal=True``, no ``key_padding_mask`` and ``need_weights=False`` the ``attn_mask`` is not read — of
any shape — and the call is causal (upper-left, over the extra keys of ``add_bias_kv`` / ``add_zero_attn``
too); with a padding mask or ``need_weights=True`` the mask is read (and must have its shape) and the hint
is unused. torch's own ``test_is_causal_kernels`` passes a mask of another shape under the hint.
"""
import pytest
import torch

from _mha_pair import make_pair

# torch's note when a float attn_mask meets a bool key_padding_mask; the case is meant.
pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")

F64 = torch.float64
E, H, B = 8, 2, 3
TOL = dict(rtol=1e-10, atol=1e-10)


def _pair(**kwargs):
    torch.manual_seed(0)
    return make_pair(E, H, **kwargs)


def _outputs_and_grads(module, args, **call):
    out = module(*args, **call)[0]
    leaves = [a for a in args if a.requires_grad] + list(module.parameters())
    return (out, *torch.autograd.grad((out * torch.linspace(-1, 1, out.numel(), dtype=F64).view(out.shape)).sum(),
                                      leaves))


MODULES = {"default": {}, "batch-first": dict(batch_first=True), "bias-kv": dict(add_bias_kv=True),
           "zero-attn": dict(add_zero_attn=True), "kdim": dict(kdim=6, vdim=5)}


@pytest.mark.parametrize("config", MODULES)
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_a_mask_of_another_shape_is_not_read_under_the_hint(config, batched):
    kwargs = MODULES[config]
    reference, ours = _pair(**kwargs)
    L, S = 4, 6
    g = torch.Generator().manual_seed(1)

    def t(n, d):
        shape = ((B, n, d) if kwargs.get("batch_first") else (n, B, d)) if batched else (n, d)
        return torch.randn(shape, generator=g, dtype=F64, requires_grad=True)

    args = (t(L, E), t(S, kwargs.get("kdim", E)), t(S, kwargs.get("vdim", E)))
    # torch's test_is_causal_kernels: the square mask of another length; and a 3-D one of other sizes.
    masks = [torch.nn.Transformer.generate_square_subsequent_mask(L + 3, dtype=F64),
             torch.zeros(7, 2, 9, dtype=torch.bool)] if batched else \
        [torch.nn.Transformer.generate_square_subsequent_mask(L + 3, dtype=F64)]
    for mask in masks:
        got = _outputs_and_grads(ours, args, attn_mask=mask, is_causal=True, need_weights=False)
        expected = _outputs_and_grads(reference, args, attn_mask=mask, is_causal=True, need_weights=False)
        for i, (a, b) in enumerate(zip(got, expected)):
            torch.testing.assert_close(a, b, **TOL, msg=lambda m, i=i: f"{config}, mask {tuple(mask.shape)}, "
                                                                         f"tensor {i}: {m}")
    # Where torch reads the mask (a padding mask, or need_weights) it must have its shape: both refuse.
    padding = torch.zeros((B, S) if batched else (S,), dtype=torch.bool)
    for call in (dict(key_padding_mask=padding, need_weights=False), dict(need_weights=True)):
        with pytest.raises(RuntimeError, match="shape of the 2D attn_mask"):
            reference(*args, attn_mask=masks[0], is_causal=True, **call)
        with pytest.raises(ValueError, match=r"attn_mask must be \[L, S\]"):
            ours(*args, attn_mask=masks[0], is_causal=True, **call)


def test_what_torch_still_checks_of_an_unread_mask():
    reference, ours = _pair()
    x = torch.randn(4, E, dtype=F64)  # unbatched: torch checks a 3-D mask's whole shape even under the hint
    for mask in (torch.zeros(H, 5, 5, dtype=torch.bool), torch.zeros(1, 1, 4, 4, dtype=torch.bool)):
        with pytest.raises(AssertionError):
            reference(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)
        with pytest.raises(ValueError, match="attn_mask must be"):
            ours(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)
    with pytest.raises(TypeError, match="attn_mask must be a bool tensor .* or a float tensor"):
        ours(x, x, x, attn_mask=torch.zeros(4, 4, dtype=torch.long), is_causal=True, need_weights=False)


def test_a_mask_that_is_not_read_gets_no_gradient_and_a_wrong_hint_gives_the_causal_answer():
    reference, ours = _pair(batch_first=True)
    x = torch.randn(B, 5, E, dtype=F64)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5, dtype=F64)
    learned = torch.randn(5, 5, dtype=F64, requires_grad=True)  # not causal: the hint is wrong
    got = ours(x, x, x, attn_mask=learned, is_causal=True, need_weights=False)[0]
    expected = reference(x, x, x, attn_mask=learned, is_causal=True, need_weights=False)[0]
    torch.testing.assert_close(got, expected, **TOL)
    torch.testing.assert_close(got, ours(x, x, x, attn_mask=causal, need_weights=False)[0], **TOL)
    assert torch.autograd.grad(got.sum(), learned, allow_unused=True) == (None,)
    # With a padding mask torch reads the mask and drops the hint: so do we (the mask's gradient included).
    padding = torch.zeros(B, 5, dtype=torch.bool)
    padding[1, 3:] = True
    got = ours(x, x, x, attn_mask=learned, key_padding_mask=padding, is_causal=True, need_weights=False)[0]
    expected = reference(x, x, x, attn_mask=learned, key_padding_mask=padding, is_causal=True, need_weights=False)[0]
    torch.testing.assert_close(got, expected, **TOL)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), learned)[0],
                               torch.autograd.grad(expected.sum(), learned)[0], **TOL)


def test_under_dropout_of_one_the_hint_still_replaces_the_mask():
    reference, ours = _pair()
    reference.dropout = ours.dropout = 1.0
    x = torch.randn(4, B, E, dtype=F64)
    mask = torch.zeros(9, 9, dtype=torch.bool)
    got = ours(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0]
    torch.testing.assert_close(got, reference(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0], **TOL)
    torch.testing.assert_close(got, ours.out_proj.bias.expand_as(got), **TOL)


def test_torch_fast_path_reads_the_mask_where_its_slow_path_and_we_do_not():
    # Documented difference: torch's inference fast path (eval, no grad, batch_first self attention, bool
    # mask) ignores is_causal and reads attn_mask, so a mask of another shape fails there; this module has
    # no such path and answers as torch's slow path does.
    reference, ours = _pair(batch_first=True)
    reference.eval(), ours.eval()
    x = torch.randn(B, 4, E, dtype=F64)
    mask = torch.ones(7, 7, dtype=torch.bool).triu(1)
    with torch.no_grad():
        with pytest.raises(RuntimeError):
            reference(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            slow = reference(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0]
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
        torch.testing.assert_close(ours(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0], slow, **TOL)
