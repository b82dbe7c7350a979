"""Derivatives of ``ae.scaled_dot_product_attention``: fp64 gradcheck / gradgradcheck with every mask kind,
forward mode, ``torch.func``, and ``opcheck`` of the ops of every backend."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attn_ext as ae
from _sdpa_ref import backends, require

F64 = torch.float64
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _leaves(B=1, Hq=2, Hkv=1, L=5, S=7, D=4, Dv=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g, dtype=F64, requires_grad=True)
                 for shape in ((B, Hq, L, D), (B, Hkv, S, D), (B, Hkv, S, Dv)))


def _mask(kind, L=5, S=7, H=2):
    g = torch.Generator().manual_seed(9)
    if kind == "bool":
        mask = torch.rand(L, S, generator=g) > 0.4
        mask[2] = False  # one row without any key: zero gradients there
        return mask
    if kind == "float":
        return torch.randn(1, H, L, S, generator=g, dtype=F64).masked_fill(torch.rand(1, H, L, S, generator=g) < 0.3,
                                                                           -math.inf)
    return None


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("kind", ["none", "bool", "float", "causal"])
def test_gradcheck_and_gradgradcheck(backend, kind):
    q, k, v = _leaves()
    require(backend, q)
    mask = _mask(kind)
    padding = torch.tensor([[False] * 6 + [True]])

    def fn(q, k, v):
        out, lse = ae.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=kind == "causal", enable_gqa=True,
                                                   key_padding_mask=padding, return_lse=True, chunk_size=3,
                                                   backend=backend)
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # -inf of empty rows: no finite diff

    assert torch.autograd.gradcheck(fn, (q, k, v))
    assert torch.autograd.gradgradcheck(fn, (q, k, v))


@pytest.mark.parametrize("backend", backends())
def test_forward_mode_and_torch_func(backend):
    q, k, v = _leaves(seed=1)
    require(backend, q)
    mask = _mask("bool")

    def fn(q, k, v):
        return ae.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, backend=backend)

    tangents = tuple(torch.randn_like(t) for t in (q, k, v))
    _, jvp = torch.func.jvp(fn, tuple(t.detach() for t in (q, k, v)), tangents)
    _, expected = torch.autograd.functional.jvp(fn, tuple(t.detach() for t in (q, k, v)), tangents)
    torch.testing.assert_close(jvp, expected)
    grads = torch.func.grad(lambda *a: fn(*a).square().sum(), argnums=(0, 1, 2))(*(t.detach() for t in (q, k, v)))
    expected = torch.autograd.grad(fn(q, k, v).square().sum(), (q, k, v))
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b)
    batched = torch.func.vmap(fn)(q.detach()[None].expand(3, -1, -1, -1, -1), k.detach()[None].expand(3, -1, -1, -1, -1),
                                  v.detach()[None].expand(3, -1, -1, -1, -1))
    torch.testing.assert_close(batched[1], fn(q, k, v).detach())


def _op_names(backend):
    suffix = {"cpp": "", "reference": "_reference", "triton": "_triton"}[backend]
    return f"attention_fwd{suffix}", f"attention_bwd{suffix}"


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("kind", ["bool", "float", "causal_dropout"])
def test_opcheck(backend, kind):
    q, k, v = _leaves(B=2, Hq=2, Hkv=2, seed=2)
    require(backend, q)
    mask = None if kind == "causal_dropout" else _mask(kind).expand(2, 2, 5, 7)
    seed = torch.tensor([123], dtype=torch.int64) if kind == "causal_dropout" else None
    args = (q, k, v, mask, torch.tensor([[False] * 7, [False] * 6 + [True]]), 0.5, kind == "causal_dropout",
            0.25 if seed is not None else 0.0, seed, 3)
    fwd, bwd = (getattr(torch.ops.attn_ext, name) for name in _op_names(backend))
    torch.library.opcheck(fwd, args, test_utils=OPCHECK_TESTS)
    out, lse = fwd(*args)
    bwd_args = (torch.randn_like(out), torch.randn_like(lse), *(t if t is None else t.detach() for t in args[:5]), out.detach(),
                lse.detach(), *args[5:])
    torch.library.opcheck(bwd, bwd_args, test_utils=OPCHECK_TESTS)


def test_a_float_mask_gets_the_gradient_of_torchs_math_path():
    q, k, v = _leaves(Hkv=2)
    mask = torch.randn(5, 7, dtype=F64, generator=torch.Generator().manual_seed(3))
    mask[1, 2] = -math.inf
    ours = mask.clone().requires_grad_()
    out = ae.scaled_dot_product_attention(q, k, v, attn_mask=ours, enable_gqa=True)
    grads = torch.autograd.grad(out.pow(2).sum(), (ours, q, k, v))
    theirs = mask.clone().requires_grad_()
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=theirs, enable_gqa=True)
    expected = torch.autograd.grad(ref.pow(2).sum(), (theirs, q, k, v))
    assert expected[0].abs().max() > 1e-2 and expected[0][1, 2] == 0
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b)
