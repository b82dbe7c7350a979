"""A randomized adversary (hypothesis, seeded): shapes including N = 0 and odd head dims, strided
layouts, masks with fully padded rows, every dtype, and special values (NaN, ±inf, huge finite) planted at
random places, for every CPU-runnable backend, forward and backward, against the fp64 rule reference of
``_nan_rule.py``: NaN exactly where the reference has NaN, the FlashAttention error rule elsewhere.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import attn_ext as ae
from _helpers import require_backend
from _nan_rule import assert_nan_rule, rule_attention, rule_grads

SPECIAL = (math.nan, math.inf, -math.inf, 1e30, -1e30)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64}


@st.composite
def adversarial_problems(draw):
    B, H, M, N = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 6)), draw(st.integers(0, 11))
    D, Dv = draw(st.sampled_from([1, 3, 5, 8, 13])), draw(st.sampled_from([1, 2, 7]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    # Strided: each tensor is a transposed or sliced view of a larger buffer half the time.
    def tensor(*shape):
        if draw(st.booleans()):
            return torch.randn(*shape[:2], shape[3], shape[2], generator=gen, dtype=torch.float64).transpose(-1, -2)
        return torch.randn(*shape[:-1], 2 * shape[-1], generator=gen, dtype=torch.float64)[..., ::2]
    q, k, v = tensor(B, H, M, D), tensor(B, H, N, D), tensor(B, H, N, Dv)
    mask = None
    if N > 0 and draw(st.booleans()):
        mask = torch.rand(B, N, generator=gen) < draw(st.sampled_from([0.3, 1.0]))
    for _ in range(draw(st.integers(0, 3))):  # special values at random places of q, k or v
        target = draw(st.sampled_from([t for t in (q, k, v) if t.numel() > 0]))
        index = tuple(draw(st.integers(0, s - 1)) for s in target.shape)
        target[index] = draw(st.sampled_from(SPECIAL))
    return q, k, v, mask


def _check(ours, ref64, same, name, grad=False, ulps=1.0):
    """:func:`assert_nan_rule`, except where PyTorch's own fp32 computation is non-finite but fp64's is not:
    the input lies outside fp32's range there (a score of 1e60 is inf in fp32), and a kernel computing in
    fp32 as the library specifies may give NaN or the fp64 value alike."""
    if same is not None:
        in_range = ~(~torch.isfinite(same) & torch.isfinite(ref64))
        ours, ref64, same = ours.detach()[in_range], ref64[in_range], same[in_range]
    assert_nan_rule(ours, ref64, same, name, grad=grad, floor_ulps=ulps)


def _same_precision_grads(q, k, v, mask, grad_out, grad_lse, dtype, scale):
    """The rule computed by PyTorch in fp32 (the half types compute in fp32): the error calibration. fp64 has
    none (it is the reference's own precision): there the check is agreement to 1e-9 relative."""
    if dtype == torch.float64:
        return (None, None, None)
    return rule_grads(q, k, v, mask, grad_out, grad_lse, dtype=torch.float32, scale=scale)


# Triton takes fp16/bf16/fp32 only (a forced fp64 call raises, tested in test_dispatch.py).
CASES = [(backend, dtype) for backend in ("cpp", "reference", "triton") for dtype in DTYPES
         if not (backend == "triton" and dtype == "float64")]


@pytest.mark.parametrize("backend,dtype_name", CASES)
@seed(20261125)
@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(problem=adversarial_problems(), chunk=st.integers(1, 5))
def test_every_backend_follows_the_fp64_rule_on_adversarial_inputs(backend, dtype_name, problem, chunk):
    dtype = DTYPES[dtype_name]
    q, k, v, mask = (None if t is None else t.to(dtype) if t.is_floating_point() else t for t in problem)
    require_backend(backend, q)
    scale = 1.0 / math.sqrt(q.shape[-1])
    # Rounding floor: on problems this small PyTorch's own error can be near 0 by luck, so the bound also
    # allows the ulps a dot product over the keys and the head dim may lose (Higham: about n·u).
    ulps = 4 + (k.shape[2] + q.shape[-1]) / 2
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out, lse = ae.cross_attention(*leaves, key_padding_mask=mask, chunk_size=chunk, return_lse=True,
                                  backend=backend)
    q64, k64, v64 = (t.double() for t in (q, k, v))
    out64, lse64 = rule_attention(q64, k64, v64, mask, scale)
    same_out, same_lse = (None, None) if dtype == torch.float64 else rule_attention(q.float(), k.float(), v.float(),
                                                                                  mask, scale)
    _check(out, out64, same_out, f"{backend} {dtype_name} out", ulps=ulps)
    _check(lse, lse64, same_lse, f"{backend} {dtype_name} lse", ulps=ulps)

    gen = torch.Generator().manual_seed(1)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(dtype)
    grad_lse = torch.randn(lse.shape, generator=gen, dtype=torch.float64).to(lse.dtype)
    grads = torch.autograd.grad((out, lse), leaves, (grad_out, grad_lse))
    if k.shape[2] == 0:  # no key: every gradient is exactly 0
        assert all(bool((g == 0).all()) for g in grads)
        return
    expected = rule_grads(q, k, v, mask, grad_out, grad_lse, scale=scale)
    calibration = _same_precision_grads(q, k, v, mask, grad_out, grad_lse, dtype, scale)
    for name, got, ref, same in zip("qkv", grads, expected, calibration):
        _check(got, ref, same, f"{backend} {dtype_name} grad {name}", grad=True, ulps=ulps)
