"""The C++ (CPU) kernels of ``attn_ext::attention_fwd`` / ``attention_bwd``, called directly, against a
dense formula written here: SDPA's math path (scores ``scale·q·kᵀ`` plus a float mask, pairs that take
no part set to −inf, softmax, dropout ``Z = keep / (1 − p)`` with the keep mask of the Philox reference,
``out = (P∘Z)·v``), in fp64 for the ground truth and in the inputs' dtype for the FlashAttention error
rule. Rows without any pair taking part give out 0, lse −inf and zero gradients (as SDPA since torch 2.5)."""
from __future__ import annotations

import math

import pytest
import torch

from _helpers import assert_within_flash_rule
from _sdpa_ref import allowed_pairs
from attn_ext.ops.attention.dropout import keep_mask

ops = torch.ops.attn_ext
SEED = 0x5DEECE66D12345


def dense(q, k, v, attn_mask=None, key_padding_mask=None, scale=None, is_causal=False, dropout_p=0.0, seed=SEED):
    """(out, lse) by the full-matrix formula in q's dtype (lse in fp32, fp64 for fp64), differentiable."""
    B, Hq, L, D = q.shape
    S = k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    group = Hq // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    allowed = allowed_pairs(attn_mask, key_padding_mask, is_causal, B, Hq, L, S)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        scores = scores + torch.where(allowed, attn_mask, torch.zeros_like(attn_mask))
    empty = ~allowed.any(dim=-1, keepdim=True)
    safe = torch.where(allowed, scores, torch.full_like(scores, -math.inf))
    safe = torch.where(empty, torch.zeros_like(safe), safe)
    lse = torch.logsumexp(safe, dim=-1, keepdim=True)
    probs = torch.where(allowed, torch.exp(safe - lse), torch.zeros_like(safe))
    if dropout_p > 0:
        probs = probs * (keep_mask(seed, dropout_p, (B, Hq, L, S)).to(probs.dtype) / (1.0 - dropout_p))
    out = torch.matmul(probs, v)
    lse = torch.where(empty, torch.full_like(lse, -math.inf), lse)[..., 0]
    return out, lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)


def make_mask(kind, B, Hq, L, S, dtype, gen):
    """A [B, Hq, L, S] attn_mask view of the given broadcast pattern (stride 0 where broadcast)."""
    def bool_of(*shape):
        return torch.rand(*shape, generator=gen) > 0.3

    def float_of(*shape):
        m = torch.randn(*shape, generator=gen).to(dtype)
        return m.masked_fill(torch.rand(*shape, generator=gen) < 0.25, -math.inf)

    if kind is None:
        return None
    full = (B, Hq, L, S)
    return {
        "bool_full": lambda: bool_of(*full),
        "bool_bcast": lambda: bool_of(1, 1, L, S).expand(full),
        "bool_keys": lambda: bool_of(B, 1, 1, S).expand(full),
        "bool_transposed": lambda: bool_of(B, Hq, S, L).transpose(-1, -2),
        "float_bcast": lambda: float_of(L, S).expand(full),
        "float_cols": lambda: float_of(B, 1, L, 1).expand(full),
    }[kind]()


def make_inputs(B, Hq, Hkv, L, S, D, Dv, dtype, layout, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(H, n, d):
        if layout == "transposed":
            return torch.randn(B, n, H, d, generator=gen).to(dtype).transpose(1, 2)
        if layout == "strided_last":
            return torch.randn(B, H, n, 2 * d, generator=gen).to(dtype)[..., ::2]
        return torch.randn(B, H, n, d, generator=gen).to(dtype)

    return rand(Hq, L, D), rand(Hkv, S, D), rand(Hkv, S, Dv), gen


def cpp(q, k, v, attn_mask=None, key_padding_mask=None, scale=None, is_causal=False, dropout_p=0.0, seed=SEED,
        chunk=512):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    seed_t = torch.tensor([seed], dtype=torch.int64) if dropout_p > 0 else None
    return ops.attention_fwd(q, k, v, attn_mask, key_padding_mask, scale, is_causal, dropout_p, seed_t, chunk)


def cpp_grads(q, k, v, out, lse, grad_out, grad_lse, attn_mask=None, key_padding_mask=None, scale=None,
              is_causal=False, dropout_p=0.0, seed=SEED, chunk=512):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    seed_t = torch.tensor([seed], dtype=torch.int64) if dropout_p > 0 else None
    return ops.attention_bwd(grad_out, grad_lse, q, k, v, attn_mask, key_padding_mask, out, lse, scale, is_causal,
                             dropout_p, seed_t, chunk)


def dense_grads(q, k, v, grad_out, grad_lse, dtype, **kw):
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    mask = kw.get("attn_mask")
    if mask is not None and mask.dtype != torch.bool:
        kw = dict(kw, attn_mask=mask.to(dtype))
    out, lse = dense(*leaves, **kw)
    return torch.autograd.grad((out, lse), leaves, (grad_out.to(dtype), grad_lse.to(lse.dtype)), allow_unused=True)


# name: B, Hq, Hkv, L, S, D, Dv, dtype, mask kind, key padding, causal, dropout, layout, chunk
CASES = {
    "plain": (2, 2, 2, 33, 47, 16, 16, torch.float32, None, False, False, 0.0, "contiguous", 16),
    "bool_full_padding": (2, 2, 2, 40, 70, 16, 16, torch.float32, "bool_full", True, False, 0.0, "contiguous", 32),
    "bool_keys_causal_L>S": (2, 2, 2, 70, 50, 16, 12, torch.float32, "bool_keys", False, True, 0.0, "contiguous", 16),
    "causal_L<S_gqa": (2, 4, 2, 20, 90, 16, 16, torch.float32, None, True, True, 0.0, "transposed", 32),
    "causal_L=1": (2, 2, 2, 1, 30, 8, 8, torch.float32, None, False, True, 0.0, "contiguous", 8),
    "mqa_float_D7": (2, 4, 1, 25, 31, 7, 5, torch.float32, "float_bcast", False, False, 0.0, "contiguous", 8),
    "fp16_transposed_D33": (2, 2, 1, 30, 41, 33, 20, torch.float16, "bool_transposed", True, False, 0.0,
                            "transposed", 16),
    "bf16_float_cols_causal": (2, 2, 2, 36, 36, 16, 24, torch.bfloat16, "float_cols", False, True, 0.0,
                               "strided_last", 16),
    "fp64_gqa_all": (2, 4, 2, 30, 44, 9, 11, torch.float64, "bool_full", True, True, 0.0, "contiguous", 16),
    "key_splits": (1, 1, 1, 64, 2000, 64, 64, torch.float32, "bool_bcast", False, False, 0.0, "contiguous", 512),
    "key_splits_causal": (1, 1, 1, 64, 2000, 64, 64, torch.float32, None, True, True, 0.0, "contiguous", 512),
    "dropout": (2, 2, 2, 30, 45, 16, 16, torch.float32, None, False, False, 0.2, "contiguous", 16),
    "dropout_gqa_causal_mask": (2, 4, 2, 40, 40, 16, 8, torch.float32, "float_bcast", True, True, 0.3,
                                "transposed", 16),
    "dropout_fp64": (1, 2, 1, 17, 23, 5, 6, torch.float64, "bool_keys", False, True, 0.5, "contiguous", 8),
    "dropout_bf16": (1, 2, 2, 33, 65, 16, 16, torch.bfloat16, None, False, False, 0.1, "contiguous", 32),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_dense_formula(name):
    B, Hq, Hkv, L, S, D, Dv, dtype, mask_kind, padded, causal, p, layout, chunk = CASES[name]
    q, k, v, gen = make_inputs(B, Hq, Hkv, L, S, D, Dv, dtype, layout)
    mask = make_mask(mask_kind, B, Hq, L, S, dtype, gen)
    kpm = (torch.rand(B, S, generator=gen) < 0.3) if padded else None
    kw = dict(attn_mask=mask, key_padding_mask=kpm, is_causal=causal, dropout_p=p)
    out, lse = cpp(q, k, v, chunk=chunk, **kw)
    assert out.dtype == dtype and out.shape == (B, Hq, L, Dv) and out.is_contiguous()
    grad_out = torch.randn(B, Hq, L, Dv, generator=gen).to(dtype)
    grad_lse = torch.randn(B, Hq, L, generator=gen).to(lse.dtype)
    grads = cpp_grads(q, k, v, out, lse, grad_out, grad_lse, chunk=chunk, **kw)
    kw64 = dict(kw, attn_mask=None if mask is None else (mask if mask.dtype == torch.bool else mask.double()))
    out64, lse64 = dense(q.double(), k.double(), v.double(), **kw64)
    refs64 = dense_grads(q, k, v, grad_out, grad_lse, torch.float64, **kw)
    if dtype == torch.float64:  # no higher precision at hand: fp64 agreement to rounding
        for label, ours, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (out64, lse64, *refs64)):
            torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name} {label}: {m}")
    else:
        out_pt, lse_pt = dense(q, k, v, **kw)
        assert_within_flash_rule(out, out64, out_pt, name=f"{name} out")
        assert_within_flash_rule(lse, lse64, lse_pt, name=f"{name} lse")
        refs_pt = dense_grads(q, k, v, grad_out, grad_lse, dtype, **kw)
        for label, ours, ref, pt in zip(("dq", "dk", "dv"), grads, refs64, refs_pt):
            assert ours.dtype == dtype and ours.is_contiguous()
            assert_within_flash_rule(ours, ref, pt, grad=True, name=f"{name} {label}")
    # Rows without pairs: exactly (0, −inf) and zero dq; keys no query of their group attends: zero dk, dv.
    allowed = allowed_pairs(mask, kpm, causal, B, Hq, L, S)
    empty = ~allowed.any(dim=-1)
    assert bool((out[empty] == 0).all()) and bool((lse[empty] == -math.inf).all())
    assert bool((grads[0][empty] == 0).all())
    unused = ~allowed.view(B, Hkv, Hq // Hkv, L, S).any(dim=2).any(dim=2)
    assert bool((grads[1][unused] == 0).all()) and bool((grads[2][unused] == 0).all())


def test_cross_attention_is_the_unmasked_case():
    """cross_attention_fwd/bwd are the same kernels: bit-identical results."""
    q, k, v, gen = make_inputs(2, 3, 3, 37, 53, 16, 8, torch.float32, "transposed")
    kpm = torch.rand(2, 53, generator=gen) < 0.3
    out, lse = ops.cross_attention_fwd(q, k, v, kpm, 0.3, 16)
    out2, lse2 = ops.attention_fwd(q, k, v, None, kpm, 0.3, False, 0.0, None, 16)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    go, gl = torch.randn_like(out), torch.randn_like(lse)
    g1 = ops.cross_attention_bwd(go, gl, q, k, v, kpm, out, lse, 0.3, 16)
    g2 = ops.attention_bwd(go, gl, q, k, v, None, kpm, out, lse, 0.3, False, 0.0, None, 16)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 2)])
def test_dropout_pattern_is_the_philox_reference(Hq, Hkv):
    """q = 0 makes P uniform and v = I makes out[m, n] = Z[m, n] / S: the kernel's own keep mask."""
    B, L, S, p = 2, 50, 64, 0.3
    q = torch.zeros(B, Hq, L, 8, dtype=torch.float64)
    k = torch.randn(B, Hkv, S, 8, dtype=torch.float64)
    v = torch.eye(S, dtype=torch.float64).expand(B, Hkv, S, S)
    out, lse = cpp(q, k, v, dropout_p=p, chunk=16)
    z = out * S
    expected = keep_mask(SEED, p, (B, Hq, L, S)).double() / (1 - p)
    torch.testing.assert_close(z, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.full_like(lse, math.log(S)))  # of the undropped scores
    rate, sd = float((z > 0).double().mean()), math.sqrt(p * (1 - p) / z.numel())
    assert abs(rate - (1 - p)) < 5 * sd
    assert torch.equal(cpp(q, k, v, dropout_p=p, chunk=16)[0], out)  # deterministic
    assert not torch.equal(cpp(q, k, v, dropout_p=p, seed=SEED + 1, chunk=16)[0], out)


def test_nan_in_pairs_that_take_no_part_is_not_read():
    """NaN/inf in masked keys' k and v, in an empty row's q and grad_out, give what finite values there give."""
    B, H, L, S, D = 2, 2, 12, 20, 8
    q, k, v, gen = make_inputs(B, H, H, L, S, D, D, torch.float32, "contiguous")
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[0, 15:] = True
    kpm[1, 0] = True  # causal row 0 of batch 1 then has no key: an empty row
    mask = torch.ones(1, 1, 1, S, dtype=torch.bool).expand(B, H, L, S).clone()
    mask[..., 3] = False
    grad_out, grad_lse = torch.randn(B, H, L, D, generator=gen), torch.randn(B, H, L, generator=gen)
    bad = [t.clone() for t in (q, k, v, grad_out)]
    for t in bad[1:3]:
        t[:, :, 3] = math.nan  # masked by attn_mask
        t[0, :, 16] = math.inf  # padding
        t[1, :, 18] = -math.inf  # causal: key 18 > every query
    bad[0][1, :, 0] = math.nan
    bad[3][1, :, 0] = math.inf
    for chunk in (4, 512):
        runs = []
        for qq, kk, vv, go in (bad, (q, k, v, grad_out)):
            out, lse = cpp(qq, kk, vv, mask, kpm, is_causal=True, chunk=chunk)
            runs.append((out, lse, *cpp_grads(qq, kk, vv, out, lse, go, grad_lse, mask, kpm, is_causal=True,
                                                chunk=chunk)))
        for label, ours, clean in zip(("out", "lse", "dq", "dk", "dv"), *runs):
            torch.testing.assert_close(ours, clean, rtol=1e-5, atol=1e-6, msg=lambda m: f"{label} chunk {chunk}: {m}")
    # A NaN in a pair that takes part does reach its row.
    v_nan = v.clone()
    v_nan[0, 0, 5] = math.nan
    out, _ = cpp(q, k, v_nan, mask, kpm, is_causal=True)
    assert bool(out[0, 0, 5:].isnan().all()) and not bool(out[0, 0, :5].isnan().any()) and not bool(out[1].isnan().any())


def test_fully_masked_rows_and_empty_keys():
    q, k, v, _ = make_inputs(1, 2, 2, 6, 5, 4, 3, torch.float32, "contiguous")
    mask = torch.zeros(1, 1, 6, 5).expand(1, 2, 6, 5).clone()
    mask[:, :, 2:] = -math.inf  # rows 2.. masked by an additive −inf
    out, lse = cpp(q, k, v, mask)
    assert bool((out[:, :, 2:] == 0).all()) and bool((lse[:, :, 2:] == -math.inf).all())
    assert bool(lse[:, :, :2].isfinite().all())
    grads = cpp_grads(q, k, v, out, lse, torch.ones_like(out), torch.ones_like(lse), mask)
    assert bool((grads[0][:, :, 2:] == 0).all()) and all(bool(g.isfinite().all()) for g in grads)
    out, lse = cpp(q, k[:, :, :0], v[:, :, :0])
    assert bool((out == 0).all()) and bool((lse == -math.inf).all())


def test_argument_errors_name_the_shapes():
    q, k, v, _ = make_inputs(1, 3, 2, 4, 5, 8, 8, torch.float32, "contiguous")
    with pytest.raises(ValueError, match=r"multiple of k's and v's heads Hkv = 2"):
        ops.attention_fwd(q, k, v, None, None, 1.0, False, 0.0, None, 16)
    q = q[:, :2]
    with pytest.raises(ValueError, match=r"attn_mask must be \[B, Hq, L, S\] = \[1, 2, 4, 5\]"):
        ops.attention_fwd(q, k, v, torch.ones(4, 5, dtype=torch.bool), None, 1.0, False, 0.0, None, 16)
    with pytest.raises(TypeError, match="attn_mask must be bool"):
        ops.attention_fwd(q, k, v, torch.ones(1, 2, 4, 5, dtype=torch.float64), None, 1.0, False, 0.0, None, 16)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        ops.attention_fwd(q, k, v, None, None, 1.0, False, 1.0, torch.tensor([1]), 16)
    with pytest.raises(ValueError, match="needs a dropout_seed"):
        ops.attention_fwd(q, k, v, None, None, 1.0, False, 0.5, None, 16)
    with pytest.raises(ValueError, match=r"key_padding_mask must be \[B, S\] = \[1, 5\]"):
        ops.attention_fwd(q, k, v, None, torch.zeros(1, 4, dtype=torch.bool), 1.0, False, 0.0, None, 16)
    out, lse = ops.attention_fwd(q, k, v, None, None, 1.0, False, 0.0, None, 16)
    with pytest.raises(ValueError, match=r"lse .* must be \[B, Hq, L\]"):
        ops.attention_bwd(out, lse[..., :2], q, k, v, None, None, out, lse[..., :2], 1.0, False, 0.0, None, 16)


def test_opcheck():
    q, k, v, gen = make_inputs(2, 4, 2, 9, 11, 8, 6, torch.float32, "contiguous")
    mask = make_mask("float_bcast", 2, 4, 9, 11, torch.float32, gen)
    kpm = torch.rand(2, 11, generator=gen) < 0.2
    seed = torch.tensor([SEED])
    args = (q, k, v, mask, kpm, 0.4, True, 0.25, seed, 4)
    torch.library.opcheck(ops.attention_fwd.default, args)
    out, lse = ops.attention_fwd(*args)
    torch.library.opcheck(ops.attention_bwd.default,
                          (torch.randn_like(out), torch.randn_like(lse), q, k, v, mask, kpm, out, lse, 0.4, True, 0.25,
                           seed, 4))
