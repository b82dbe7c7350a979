"""The Triton attention op pair (``attention_forward`` / ``attention_backward``) against a dense fp64 formula.

Masks as SDPA's math path (bool True = take part, float added to the scaled score, causal = lower
triangle of ``ones(L, S)``), key padding True = padded, GQA as ``repeat_interleave`` of the key/value
heads, dropout as the library's counter-based Philox keep mask (``attn_ext.ops.attention.dropout``). Accuracy follows the FlashAttention rule of ``_helpers``: the error against fp64 is
at most 2x (3x for gradients) that of the same formula computed by PyTorch in the inputs' precision.
Sizes are small: the kernels run in the Triton interpreter on CPU.
"""
from __future__ import annotations

import math

import pytest
import torch

from _helpers import assert_within_flash_rule, worse_of
from _sdpa_ref import allowed_pairs
from attn_ext.ops.utils.triton import triton_unavailable_reason

pytestmark = pytest.mark.skipif(triton_unavailable_reason("cpu") is not None,
                                reason=f"Triton interpreter unavailable: {triton_unavailable_reason('cpu')}")

SEED = 0x1234_5678_9ABC  # both key words nonzero


# ----------------------------------------------------------------------------------------- references

def keep_mask(seed: int, p: float, B: int, H: int, L: int, S: int) -> torch.Tensor:
    """The library's statement of the dropout generator (Philox4x32-10, its own tests check the known answers)."""
    from attn_ext.ops.attention.dropout import keep_mask as library_keep_mask

    return library_keep_mask(seed, p, (B, H, L, S))


def dense(q, k, v, attn_mask, kpm, scale, causal, p, keep, dtype):
    """``(out, lse)`` of the full-matrix formula in ``dtype``; empty rows (0, -inf) with zero gradients."""
    B, H, L, _ = q.shape
    g = H // k.shape[1]
    q, k, v = q.to(dtype), k.to(dtype).repeat_interleave(g, 1), v.to(dtype).repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * scale
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        s = s + attn_mask.to(dtype)
    s = s.masked_fill(~allowed_pairs(attn_mask, kpm, causal, B, H, L, k.shape[2]), -math.inf)
    empty = (s == -math.inf).all(-1, keepdim=True)
    s = torch.where(empty, 0.0, s)
    lse = torch.logsumexp(s, -1, keepdim=True)
    probs = torch.where(empty, 0.0, torch.exp(s - lse))
    if p > 0:
        probs = probs * keep / (1 - p)
    return probs @ v, torch.where(empty, -math.inf, lse)[..., 0]


def dense_grads(q, k, v, mask, kpm, scale, causal, p, keep, grad_out, grad_lse, dtype):
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    out, lse = dense(*leaves, mask, kpm, scale, causal, p, keep, dtype)
    return torch.autograd.grad((out, lse), leaves, (grad_out.to(dtype), grad_lse.to(lse.dtype)))


def flash_formula_grads(q, k, v, mask, kpm, scale, causal, p, keep, grad_out, grad_lse):
    """The FlashAttention backward as full-matrix PyTorch in the inputs' dtype (its ``dO·v − Δ`` cancels
    where autograd's does not: the rule calibrates against the worse of the two)."""
    B, H, L, _ = q.shape
    g = H // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    out, lse = dense(q, k, v, mask, kpm, scale, causal, p, keep, q.dtype)
    s = q @ kk.transpose(-1, -2) * scale
    if mask is not None and mask.dtype != torch.bool:
        s = s + mask
    allowed = allowed_pairs(mask, kpm, causal, B, H, L, kk.shape[2]) & torch.isfinite(lse)[..., None]
    probs = torch.where(allowed, torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    z = (keep / (1 - p)).to(q.dtype) if p > 0 else torch.ones_like(probs)
    delta = (grad_out * out).sum(-1, keepdim=True)
    ds = probs * ((grad_out @ vv.transpose(-1, -2)) * z - delta + grad_lse.to(q.dtype)[..., None])
    dq = ds @ kk * scale
    dk = (ds.transpose(-1, -2) @ q * scale).unflatten(1, (-1, g)).sum(2)
    dv = ((probs * z).transpose(-1, -2) @ grad_out).unflatten(1, (-1, g)).sum(2)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------- cases

def _attn_mask(kind, B, H, L, S, dtype, gen):
    if kind == "none":
        return None
    if kind == "bool":  # broadcast over batch and heads: strides 0
        mask = torch.rand(1, 1, L, S, generator=gen) > 0.3
        mask[..., 0] = True
        return mask.expand(B, H, L, S)
    if kind == "bool_transposed":  # a view of an [S, L] tensor: unit stride along the queries
        mask = torch.rand(B, H, S, L, generator=gen) > 0.4
        return mask.transpose(-1, -2)
    if kind == "float":  # per-key bias broadcast over queries, some keys masked by -inf
        bias = torch.randn(B, 1, 1, S, generator=gen).to(dtype)
        bias[..., 1::5] = -math.inf
        return bias.expand(B, H, L, S)
    raise ValueError(kind)


# id: (B, Hq, Hkv, L, S, D, Dv, attn mask, key padding, causal, dropout p, dtype)
CASES = {
    "plain-fp32": (2, 2, 2, 24, 40, 16, 16, "none", False, False, 0.0, torch.float32),
    "bool-bcast-gqa-fp16": (2, 4, 2, 24, 33, 16, 16, "bool", False, False, 0.0, torch.float16),
    "float-bcast-causal-L>S-bf16": (1, 2, 1, 40, 24, 32, 16, "float", False, True, 0.0, torch.bfloat16),
    "causal-L<S-oddD-fp32": (1, 2, 2, 17, 40, 13, 9, "none", False, True, 0.0, torch.float32),
    "bool-transposed-padding-fp32": (2, 2, 1, 20, 24, 8, 8, "bool_transposed", True, False, 0.0, torch.float32),
    "dropout-causal-gqa-bf16": (1, 4, 2, 24, 32, 16, 16, "bool", False, True, 0.3, torch.bfloat16),
    "dropout-float-padding-fp16": (2, 2, 2, 20, 28, 16, 24, "float", True, False, 0.6, torch.float16),
    "dropout-fp32": (1, 3, 1, 19, 21, 32, 32, "none", False, False, 0.2, torch.float32),
}


def make_case(name, seed=0):
    B, Hq, Hkv, L, S, D, Dv, mask_kind, padding, causal, p, dtype = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, L, D, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, S, Dv, generator=gen).to(dtype)
    mask = _attn_mask(mask_kind, B, Hq, L, S, dtype, gen)
    kpm = (torch.rand(B, S, generator=gen) < 0.25) if padding else None
    keep = keep_mask(SEED, p, B, Hq, L, S) if p > 0 else None
    return dict(q=q, k=k, v=v, mask=mask, kpm=kpm, scale=D ** -0.5, causal=causal, p=p, keep=keep)


def run_forward(c, chunk_size=16):
    from attn_ext.ops.attention.triton_fwd import attention_forward

    return attention_forward(c["q"], c["k"], c["v"], c["mask"], c["kpm"], c["scale"], c["causal"], c["p"],
                             torch.tensor([SEED]), chunk_size)


def run_backward(c, out, lse, grad_out, grad_lse, chunk_size=16):
    from attn_ext.ops.attention.triton_bwd import attention_backward

    return attention_backward(grad_out, grad_lse, c["q"], c["k"], c["v"], c["mask"], c["kpm"], out, lse, c["scale"],
                              c["causal"], c["p"], torch.tensor([SEED]), chunk_size)


def _ref_args(c):
    return c["q"], c["k"], c["v"], c["mask"], c["kpm"], c["scale"], c["causal"], c["p"], c["keep"]


# ----------------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_fp64(name):
    c = make_case(name)
    out, lse = run_forward(c)
    B, Hq, L, _ = c["q"].shape
    assert out.dtype == c["q"].dtype and out.shape == (B, Hq, L, c["v"].shape[-1]) and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == (B, Hq, L)
    out64, lse64 = dense(*_ref_args(c), torch.float64)
    out_pt, lse_pt = dense(*_ref_args(c), c["q"].dtype)
    assert_within_flash_rule(out, out64, out_pt, name=f"{name} out")
    assert_within_flash_rule(lse, lse64, lse_pt, name=f"{name} lse")


@pytest.mark.parametrize("name", list(CASES))
def test_backward_matches_fp64(name):
    c = make_case(name)
    out, lse = run_forward(c)
    gen = torch.Generator().manual_seed(5)
    grad_out = torch.randn(out.shape, generator=gen).to(out.dtype)
    grad_lse = torch.randn(lse.shape, generator=gen)
    grads = run_backward(c, out, lse, grad_out, grad_lse)
    ref = dense_grads(*_ref_args(c), grad_out, grad_lse, torch.float64)
    pt = dense_grads(*_ref_args(c), grad_out, grad_lse, c["q"].dtype)
    formula = flash_formula_grads(*_ref_args(c), grad_out, grad_lse)
    for label, g, leaf, g64, g_pt, g_formula in zip("qkv", grads, (c["q"], c["k"], c["v"]), ref, pt, formula):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape and g.is_contiguous(), label
        assert_within_flash_rule(g, g64, worse_of(g_pt, g_formula, g64), grad=True, name=f"{name} d{label}")


@pytest.mark.parametrize("p", [0.25, 0.7])  # 0.7: the threshold does not fit in an int32
def test_dropout_keep_mask_is_the_philox_reference(p):
    # v = identity: out[m, n] = P[m, n]·Z[m, n] with every P > 0, so out != 0 is the keep mask itself.
    B, Hq, L, S = 2, 3, 24, 32
    q, k = torch.randn(B, Hq, L, 8) * 0.1, torch.randn(B, 1, S, 8) * 0.1
    v = torch.eye(S).expand(B, 1, S, S)
    from attn_ext.ops.attention.triton_fwd import attention_forward

    out, _ = attention_forward(q, k, v, None, None, 1.0, False, p, torch.tensor(SEED), 16)
    expected = keep_mask(SEED, p, B, Hq, L, S)
    assert torch.equal(out != 0, expected)
    assert 0.5 * p < 1 - expected.double().mean().item() < 1.5 * p


def test_chunk_size_does_not_change_the_result_beyond_rounding():
    c = make_case("dropout-causal-gqa-bf16")
    out16, lse16 = run_forward(c, 16)
    out32, lse32 = run_forward(c, 32)
    torch.testing.assert_close(out16, out32, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse16, lse32)


def test_argument_errors():
    from attn_ext.ops.attention.triton_fwd import attention_forward

    q, k, v = torch.randn(1, 3, 4, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        attention_forward(q, k, v, None, None, 1.0, False, 0.0, None, 16)
    k, v = k[:, :1], v[:, :1]
    with pytest.raises(TypeError, match="attn_mask must be bool or torch.float32"):
        attention_forward(q, k, v, torch.zeros(1, 3, 4, 5, dtype=torch.int32), None, 1.0, False, 0.0, None, 16)
    with pytest.raises(ValueError, match=r"attn_mask must have shape \(1, 3, 4, 5\)"):
        attention_forward(q, k, v, torch.ones(1, 1, 4, 5, dtype=torch.bool), None, 1.0, False, 0.0, None, 16)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        attention_forward(q, k, v, None, None, 1.0, False, 1.0, torch.tensor(1), 16)
    with pytest.raises(ValueError, match="needs dropout_seed"):
        attention_forward(q, k, v, None, None, 1.0, False, 0.5, None, 16)
    with pytest.raises(TypeError, match="float64"):
        attention_forward(q.double(), k.double(), v.double(), None, None, 1.0, False, 0.0, None, 16)


def test_public_api_on_the_triton_backend_matches_the_reference_backend():
    import attn_ext as ae

    gen = torch.Generator().manual_seed(9)
    q, k, v = torch.randn(2, 4, 18, 16, generator=gen), torch.randn(2, 2, 22, 16, generator=gen), \
        torch.randn(2, 2, 22, 8, generator=gen)
    mask = torch.randn(18, 22, generator=gen)  # broadcast by the public API to [B, Hq, L, S]
    results = {}
    for backend in ("triton", "reference"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        torch.manual_seed(4)  # the same dropout seed for both
        out = ae.scaled_dot_product_attention(*leaves, attn_mask=mask, dropout_p=0.25, enable_gqa=True,
                                              backend=backend)
        out.backward(torch.ones_like(out))
        results[backend] = (out, *(t.grad for t in leaves))
    for name, a, b in zip(("out", "dq", "dk", "dv"), results["triton"], results["reference"]):
        torch.testing.assert_close(a, b, msg=name)
