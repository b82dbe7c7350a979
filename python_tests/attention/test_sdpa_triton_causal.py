"""The Triton kernels' causal rule at the diagonal: each kernel splits its loop into the blocks that lie
wholly on the allowed side (no per-pair test, plain GEMMs) and the blocks the diagonal crosses, so the
tests put both kinds in every program: sequences several tiles long, query tiles (32 rows in the
interpreter) both narrower and wider than the key tiles (``chunk_size`` 16 and 64), ``L = S``, ``L < S``
and ``L > S`` (top-left alignment: query ``i`` sees keys ``j <= i``), with and without an additive mask
and key padding. Forward and backward against the dense fp64 formula with FlashAttention's rule; a
non-finite value row above the diagonal must not leak into the rows that never see it.
"""
from __future__ import annotations

import pytest
import torch

from _helpers import assert_within_flash_rule, worse_of
from attn_ext.ops.utils.triton import triton_unavailable_reason
from test_sdpa_triton import SEED, dense, dense_grads, flash_formula_grads

pytestmark = pytest.mark.skipif(triton_unavailable_reason("cpu") is not None,
                                reason=f"Triton interpreter unavailable: {triton_unavailable_reason('cpu')}")

SHAPES = {"L=S": (100, 100), "L<S": (70, 130), "L>S": (130, 70)}


def _case(L, S, mask_kind, padding, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    B, H, D, Dv = 1, 2, 16, 8
    q = torch.randn(B, H, L, D, generator=gen).to(dtype)
    k = torch.randn(B, H, S, D, generator=gen).to(dtype)
    v = torch.randn(B, H, S, Dv, generator=gen).to(dtype)
    mask = torch.randn(1, H, L, S, generator=gen).to(dtype).expand(B, H, L, S) if mask_kind == "float" else None
    kpm = (torch.rand(B, S, generator=gen) < 0.2) if padding else None
    return dict(q=q, k=k, v=v, mask=mask, kpm=kpm, scale=D ** -0.5, causal=True, p=0.0, keep=None)


def _ref_args(c):
    return c["q"], c["k"], c["v"], c["mask"], c["kpm"], c["scale"], c["causal"], c["p"], c["keep"]


def _forward(c, chunk_size):
    from attn_ext.ops.attention.triton_fwd import attention_forward

    return attention_forward(c["q"], c["k"], c["v"], c["mask"], c["kpm"], c["scale"], True, 0.0,
                             torch.tensor([SEED]), chunk_size)


def _backward(c, out, lse, grad_out, grad_lse, chunk_size):
    from attn_ext.ops.attention.triton_bwd import attention_backward

    return attention_backward(grad_out, grad_lse, c["q"], c["k"], c["v"], c["mask"], c["kpm"], out, lse, c["scale"],
                              True, 0.0, torch.tensor([SEED]), chunk_size)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mask_kind,padding", [("none", False), ("float", True)])
def test_causal_forward_backward_across_the_diagonal(shape, chunk_size, mask_kind, padding):
    L, S = SHAPES[shape]
    c = _case(L, S, mask_kind, padding)
    name = f"{shape} chunk {chunk_size} {mask_kind}{' padded' if padding else ''}"
    out, lse = _forward(c, chunk_size)
    out64, lse64 = dense(*_ref_args(c), torch.float64)
    out_pt, lse_pt = dense(*_ref_args(c), torch.float32)
    assert_within_flash_rule(out, out64, out_pt, name=f"{name} out")
    assert_within_flash_rule(lse, lse64, lse_pt, name=f"{name} lse")

    gen = torch.Generator().manual_seed(7)
    grad_out, grad_lse = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    grads = _backward(c, out, lse, grad_out, grad_lse, chunk_size)
    ref = dense_grads(*_ref_args(c), grad_out, grad_lse, torch.float64)
    pt = dense_grads(*_ref_args(c), grad_out, grad_lse, torch.float32)
    formula = flash_formula_grads(*_ref_args(c), grad_out, grad_lse)
    for label, g, g64, g_pt, g_formula in zip("qkv", grads, ref, pt, formula):
        assert_within_flash_rule(g, g64, worse_of(g_pt, g_formula, g64), grad=True, name=f"{name} d{label}")


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_non_finite_value_row_above_the_diagonal_stays_there(chunk_size):
    # Key 90's value row is inf: only queries 90.. see it. Every earlier row must be finite and exact,
    # in the blocks the diagonal crosses as in the others.
    c = _case(100, 100, "none", False)
    c["v"][:, :, 90] = float("inf")
    out, lse = _forward(c, chunk_size)
    finite = dict(c, v=c["v"].clone())
    finite["v"][:, :, 90] = 0.0  # the dense formula's P @ V would give 0 * inf = NaN for the earlier rows
    out64, _ = dense(*_ref_args(finite), torch.float64)
    assert torch.isfinite(out[:, :, :90]).all()
    assert not torch.isfinite(out[:, :, 90:]).any()  # every later row sees the inf row with a positive weight
    torch.testing.assert_close(out[:, :, :90].double(), out64[:, :, :90], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(lse).all()
