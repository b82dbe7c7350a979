"""The Triton attention kernels' two code paths on a CUDA device (the interpreter tests them on the CPU in
python_tests/attention/test_triton_nonfinite_paths.py): with the causal rule or an attention mask, the forward
multiplies whole tiles and its fix-up launch recomputes the rows an inf or NaN value of V poisoned through a
masked pair; the backward takes its guarded kernels only when q or k holds one. Compiled kernels, fp16, a
causal and a float-mask call; skipped, with the reason, without a CUDA device.
"""
import math

import pytest
import torch

import attn_ext as ae
from _gpu import backends

B, H, L, S, D = 1, 2, 96, 96, 64


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=gen).to("cuda", torch.float16) for n in (L, S, S)]


@pytest.mark.parametrize("backend", backends("scaled_dot_product_attention", ("triton",)))
@pytest.mark.parametrize("mask", ["causal", "float"])
def test_masked_pairs_never_read_an_inf_value_row(backend, mask):
    q, k, v = _inputs()
    attn_mask = None
    if mask == "float":
        attn_mask = torch.randn(B, H, L, S, device="cuda").half()
        attn_mask[..., :40, 70] = -math.inf  # key 70 masked for the first 40 queries
    kw = dict(attn_mask=attn_mask, is_causal=mask == "causal", backend=backend)
    clean = ae.scaled_dot_product_attention(q, k, v, **kw)
    v2 = v.clone()
    v2[:, :, 70, 3] = math.inf
    poisoned = ae.scaled_dot_product_attention(q, k, v2, **kw)
    rows = slice(0, 40) if mask == "float" else slice(0, 70)  # the rows that do not see key 70
    assert torch.isfinite(poisoned[:, :, rows]).all(), "a masked pair read the inf row"
    # The fix-up launch's 16 x 16 tiles sum in another order than the first launch's: equal up to fp16 rounding.
    torch.testing.assert_close(poisoned[:, :, rows], clean[:, :, rows])


@pytest.mark.parametrize("backend", backends("scaled_dot_product_attention", ("triton",)))
def test_a_nan_query_row_reaches_only_the_keys_it_attends(backend):
    q, k, v = (t.requires_grad_() for t in _inputs(1))
    with torch.no_grad():
        q[0, :, 20, 5] = math.nan
    out = ae.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)
    grad_q, grad_k, grad_v = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert torch.isnan(grad_k[0, :, :21]).any() and torch.isfinite(grad_k[0, :, 21:]).all()
    assert torch.isfinite(grad_v[0, :, 21:]).all()
