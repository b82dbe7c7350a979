"""attn_ext.nn.MultiheadAttention against torch.nn.MultiheadAttention in fp64: outputs, weights and the
gradients of inputs and parameters, for every combination of module options, layouts and masks."""
import itertools
import warnings
import zlib

import pytest
import torch

import _mha_pair

F64 = torch.float64
E, H, B = 8, 2, 2
TOL = dict(rtol=1e-10, atol=1e-10)

CONFIGS = {
    "default": {},
    "no-bias": dict(bias=False),
    "kdim-vdim": dict(kdim=6, vdim=10),
    "bias-kv": dict(add_bias_kv=True),
    "zero-attn": dict(add_zero_attn=True),
    "bias-kv-zero-attn-kdim-no-bias": dict(add_bias_kv=True, add_zero_attn=True, kdim=6, vdim=10, bias=False),
}
ATTN_MASKS = [None, "bool-2d", "float-2d", "bool-3d", "float-3d"]
PADDING = [None, "bool", "float"]
WEIGHTS = [False, "average", "per-head"]


def make_pair(dtype=F64, **kwargs):
    return _mha_pair.make_pair(E, H, dtype, **kwargs)


def make_masks(kind, padding, causal, batch, L, S, g):
    """torch-convention masks (bool True = may not attend; float additive). Key 0 is never masked, so no
    row is empty (torch gives NaN there). A causal mask is the causal mask itself in any form (is_causal
    promises it: a float one is 0 where allowed)."""
    heads = H * (batch or 1)
    attn = None
    if kind is not None:
        shape = (L, S) if kind.endswith("2d") else (heads, L, S)
        banned = torch.ones(L, S, dtype=torch.bool).triu(1).expand(shape) if causal \
            else torch.rand(shape, generator=g) < 0.3
        banned = banned.clone()
        banned[..., 0] = False
        values = torch.zeros(shape, dtype=F64) if causal else torch.randn(shape, generator=g, dtype=F64)
        attn = banned if kind.startswith("bool") else values.masked_fill(banned, float("-inf"))
    pad = None
    if padding is not None:
        valid = torch.tensor([2, S][: batch or 1])
        banned = torch.arange(S)[None, :] >= valid[:, None]
        if batch is None:
            banned = banned[0]
        pad = banned if padding == "bool" else torch.randn(banned.shape, generator=g, dtype=F64).masked_fill(
            banned, float("-inf"))
    return attn, pad


def inputs(config, layout, self_attention, g):
    L, S = (5, 5) if self_attention else (5, 7)
    kdim, vdim = config.get("kdim", E), config.get("vdim", E)

    def t(n, d):
        shape = (n, d) if layout == "unbatched" else (B, n, d) if layout == "batch-first" else (n, B, d)
        return torch.randn(shape, generator=g, dtype=F64, requires_grad=True)

    if self_attention:
        x = t(L, E)
        return [x], (x, x, x), L, S
    q, k, v = t(L, E), t(S, kdim), t(S, vdim)
    return [q, k, v], (q, k, v), L, S


def run(module, args, leaves, grad_seed=5, **call):
    out, weights = module(*args, **call)
    g = torch.Generator().manual_seed(grad_seed)
    total = (out * torch.randn(out.shape, generator=g, dtype=F64)).sum()
    if weights is not None:
        total = total + (weights * torch.randn(weights.shape, generator=g, dtype=F64)).sum()
    grads = torch.autograd.grad(total, leaves + list(module.parameters()))
    return out, weights, grads


# Self-attention needs kdim = vdim = embed_dim, so the kdim configurations run as cross attention only.
CASES = [(config, layout, attention) for config in CONFIGS for layout in ("batch-first", "seq-first", "unbatched")
         for attention in ("self", "cross") if not (attention == "self" and "kdim" in CONFIGS[config])]


@pytest.mark.parametrize("config, layout, attention", CASES, ids=["-".join(c) for c in CASES])
def test_every_option_matches_torch(config, layout, attention):
    kwargs = CONFIGS[config]
    self_attention = attention == "self"
    reference, ours = make_pair(batch_first=layout == "batch-first", **kwargs)
    g = torch.Generator().manual_seed(zlib.crc32(f"{config} {layout} {attention}".encode()))
    leaves, args, L, S = inputs(kwargs, layout, self_attention, g)
    names = ["input"] * len(leaves) + [n for n, _ in ours.named_parameters()]
    assert names[len(leaves):] == [n for n, _ in reference.named_parameters()]
    checked = 0
    # Every mask combination; the three weight modes take turns (each meets every mask kind and padding).
    combos = [(k, p, c) for k, p, c in itertools.product(ATTN_MASKS, PADDING, [False, True]) if k or not c]
    for i, (kind, padding, causal) in enumerate(combos):
        weights = WEIGHTS[i % 3]
        attn_mask, pad = make_masks(kind, padding, causal, None if layout == "unbatched" else B, L, S, g)
        call = dict(attn_mask=attn_mask, key_padding_mask=pad, need_weights=bool(weights),
                    average_attn_weights=weights == "average")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's deprecation warning for a bool mask with a float one
            # Under is_causal without padding or weights, torch skips the mask and with it the extra keys'
            # column (upper-left causal over the keys and the extra ones); elsewhere it reads the mask.
            expected = run(reference, args, leaves, **call, is_causal=causal)
        got = run(ours, args, leaves, **call, is_causal=causal)
        case = f"attn_mask={kind} key_padding_mask={padding} is_causal={causal} need_weights={weights}"
        torch.testing.assert_close(got[0], expected[0], **TOL, msg=lambda m: f"output, {case}: {m}")
        if weights:
            torch.testing.assert_close(got[1], expected[1], **TOL, msg=lambda m: f"weights, {case}: {m}")
        else:
            assert got[1] is None and expected[1] is None
        for name, a, b in zip(names, got[2], expected[2]):
            torch.testing.assert_close(a, b, **TOL, msg=lambda m, name=name: f"grad of {name}, {case}: {m}")
        checked += 1
    assert checked == 27


def test_float_mask_that_requires_grad_gets_torch_gradient():
    reference, ours = make_pair(batch_first=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, 5, E, generator=g, dtype=F64)
    bias = torch.randn(5, 5, generator=g, dtype=F64, requires_grad=True)
    for need_weights in (False, True):
        got = torch.autograd.grad(ours(x, x, x, attn_mask=bias, need_weights=need_weights)[0].sum(), bias)[0]
        expected = torch.autograd.grad(reference(x, x, x, attn_mask=bias, need_weights=need_weights)[0].sum(), bias)[0]
        torch.testing.assert_close(got, expected, **TOL)


def test_no_mask_path_and_masked_path_agree():
    """The unmasked call runs on the attention-state path, a masked one on the functional op: an
    all-allowed mask must not change the result."""
    _, ours = make_pair(batch_first=True)
    x = torch.randn(B, 6, E, dtype=F64)
    plain = ours(x, x, x, need_weights=False)[0]
    masked = ours(x, x, x, need_weights=False, attn_mask=torch.zeros(6, 6, dtype=torch.bool))[0]
    torch.testing.assert_close(masked, plain, **TOL)
