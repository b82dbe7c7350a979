"""σIntention's fused CPU op ``attn_ext::sigma_intention_fwd`` (csrc/cpu/sigma_intention.cpp).

It must return exactly what the unfused composition returns (Intention without values, then the
cross attention over the transformed queries), for every dtype and shape, and gradients as accurate.
"""
import pytest
import torch

import attn_ext as ae
from attn_ext.ops.intention import ridge as functional

from _helpers import assert_within_flash_rule

F64 = torch.float64
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")

pytestmark = pytest.mark.skipif(ae.available_backends(torch.zeros(1))["cpp"] is not None,
                                reason="the C++ extension is not built")


def problem(B, H, M, N, D, Dv, dtype=F64, seed=0, padded_rows=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, d, generator=g, dtype=F64).to(dtype) for n, d in ((M, D), (N, D), (N, Dv)))
    mask = torch.rand(B, N, generator=g) < 0.3
    if padded_rows:
        mask[0] = True  # every key of batch entry 0 is padding: its rows are 0, the Gram is αI
    return q, k, v, mask


def unfused(q, k, v, alpha, mask, scale):
    """The composition the fused op replaces, through the ops' own autograd."""
    a = functional._alpha_tensor(alpha, q)
    q_tilde = torch.ops.attn_ext.intention_fwd(q, k, None, mask, a, scale)[0]
    return ae.cross_attention(q_tilde, k, v, key_padding_mask=mask, scale=1.0, backend="cpp")


SHAPES = [  # (B, H, M, N, D, Dv): odd head dims, asymmetric lengths, one query, one key, many key chunks
    (2, 3, 113, 203, 40, 24), (1, 1, 1, 239, 59, 59), (2, 1, 17, 1, 96, 8), (1, 2, 300, 600, 64, 64),
    (1, 1, 4, 1500, 16, 16),
]


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("masked", [False, True])
def test_equals_the_unfused_composition_bit_for_bit(dtype, shape, masked):
    q, k, v, mask = problem(*shape, dtype=dtype, seed=sum(shape), padded_rows=masked)
    mask = mask if masked else None
    out = ae.sigma_intention(q, k, v, alpha=0.7, key_padding_mask=mask, scale=0.9, backend="cpp")
    assert out.dtype == dtype and out.shape == (*shape[:3], shape[5])
    assert torch.equal(out, unfused(q, k, v, 0.7, mask, 0.9))
    if masked:
        assert not out[0].any()  # fully padded rows give 0, not NaN


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_gradients_equal_the_unfused_composition(dtype):
    """fp64: the same gradients as the composition to 1e-12. fp32: the fused backward orders its sums
    differently, so both paths carry their own rounding (about 2e-6 here on gradients of ~0.2); the
    fused one must be as close to the fp64 composition as the fp32 composition is (the FlashAttention
    rule for gradients), not equal to the fp32 composition's rounding."""
    q, k, v, mask = problem(2, 2, 9, 70, 40, 24, dtype=dtype, seed=3)
    alpha = torch.tensor([0.3, 2.0], dtype=dtype)
    w = torch.randn(2, 2, 9, 24, generator=torch.Generator().manual_seed(1), dtype=dtype)

    def grads(fn, to=dtype):
        inputs = tuple(t.detach().to(to).requires_grad_() for t in (q, k, v, alpha))
        out = fn(*inputs)
        return torch.autograd.grad((out * w.to(to)).sum(), inputs)

    fused = grads(lambda q, k, v, a: ae.sigma_intention(q, k, v, alpha=a, key_padding_mask=mask, scale=0.8))
    composed = grads(lambda q, k, v, a: unfused(q, k, v, a, mask, 0.8))
    if dtype == F64:
        for name, f, c in zip(("dq", "dk", "dv", "dalpha"), fused, composed):
            torch.testing.assert_close(f, c, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")
        return
    reference = grads(lambda q, k, v, a: unfused(q, k, v, a, mask, 0.8), to=F64)
    for name, f, c, r in zip(("dq", "dk", "dv", "dalpha"), fused, composed, reference):
        assert_within_flash_rule(f, r, c, grad=True, name=name)


def test_gradcheck_through_the_fused_op():
    q, k, v, mask = problem(2, 2, 3, 9, 3, 2, seed=5)
    alpha = torch.tensor([[0.2, 1.5], [0.7, 3.0]], dtype=F64, requires_grad=True)
    inputs = tuple(t.clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(
        lambda q, k, v, a: torch.ops.attn_ext.sigma_intention_fwd(q, k, v, mask, a, 0.6, 4)[0], (*inputs, alpha))
    # lse and the transformed queries are outputs too: their gradients are exact as well.
    assert torch.autograd.gradcheck(
        lambda q, k, v, a: torch.ops.attn_ext.sigma_intention_fwd(q, k, v, mask, a, 0.6, 4)[1:3], (*inputs, alpha))


@pytest.mark.parametrize("masked", [False, True])
def test_opcheck(masked):
    q, k, v, mask = problem(2, 2, 3, 11, 5, 3, seed=2)
    alpha = torch.tensor([[0.5, 1.0], [2.0, 0.1]], dtype=F64)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), mask if masked else None,
            alpha.requires_grad_(), 0.7, 4)
    torch.library.opcheck(torch.ops.attn_ext.sigma_intention_fwd, args, test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_error_within_twice_torch_own(dtype):
    """FlashAttention's rule: the error against fp64 at most 2x that of the reference computed in
    the same precision (torch ops on the rounded inputs), plus a rounding floor."""
    q, k, v, mask = problem(2, 2, 113, 203, 59, 40, seed=7)
    exact = ae.sigma_intention(q, k, v, alpha=1.0, key_padding_mask=mask, backend="reference")
    low = [t.to(dtype) for t in (q, k, v)]
    ours = ae.sigma_intention(*low, alpha=1.0, key_padding_mask=mask, backend="cpp")
    torch_q_tilde = functional.reference.transformed_queries(
        low[0].float(), low[1].float(), torch.ones(2, 2), mask, 1.0).to(dtype)
    scores = (torch_q_tilde @ low[1].transpose(-1, -2)).float().masked_fill(mask[:, None, None], float("-inf"))
    torch_out = (torch.softmax(scores, -1).to(dtype) @ low[2]).to(dtype)
    err = (ours.double() - exact).abs().max().item()
    torch_err = (torch_out.double() - exact).abs().max().item()
    assert err <= 2 * torch_err + 4 * torch.finfo(dtype).eps * exact.abs().max().item(), (err, torch_err)


def test_singular_gram_with_alpha_zero_raises():
    q, k, v, _ = problem(1, 2, 3, 5, 4, 4, seed=1)
    k[..., 2:] = 0  # the keys span 2 of 4 dimensions: KᵀK is exactly singular in every head
    with pytest.raises(RuntimeError, match=r"sigma_intention: KᵀK \+ αI is singular at \[batch, head\] = \[0, [01]\]: "
                                           r"the Cholesky pivot of column 2 of 4 .*use alpha > 0"):
        ae.sigma_intention(q, k, v, alpha=0.0, backend="cpp")


def test_non_contiguous_inputs():
    q, k, v, mask = problem(2, 3, 33, 70, 40, 24, seed=9)
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))  # row stride H·D
    out = ae.sigma_intention(qt, kt, vt, alpha=0.5, key_padding_mask=mask, backend="cpp")
    torch.testing.assert_close(out, ae.sigma_intention(q, k, v, alpha=0.5, key_padding_mask=mask,
                                                       backend="reference"), rtol=1e-10, atol=1e-10)
