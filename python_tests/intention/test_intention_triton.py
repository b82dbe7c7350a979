"""The Triton Intention kernels (attn_ext/triton/intention*.py) against the fp64 reference and fp64 autograd.

Run in the Triton interpreter on CPU, where the column-by-column factorisation costs about a second per
128 x 128 matrix: few (batch, head) pairs per case. The accuracy rule is FlashAttention's (see
``_helpers.assert_within_flash_rule``): the error against fp64 may be twice (gradients: three times) that
of the same reference computed by PyTorch in fp32, plus a floor. For fp32 the floor is ``1e-5·max|ref|``
rather than one ulp: the Cholesky of an ill-conditioned ``KᵀK + αI`` by LAPACK and by the kernel round
differently, and either may be the lucky one on a given seed.
"""
import pytest
import torch

from attn_ext.ops.intention.naive import intention_primal, statistics
from attn_ext.ops.utils.triton import triton_unavailable_reason

from _helpers import assert_within_flash_rule, make_qkv

_REASON = triton_unavailable_reason(torch.device("cpu"))
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"Triton unavailable: {_REASON}")

if _REASON is None:
    from attn_ext.ops.intention.triton_ridge import intention_bwd_triton, intention_fwd_triton

F64 = torch.float64
DV = 59  # odd and not a power of two: the padded value tile is exercised everywhere


def mask_with_sparse_entry(B: int, N: int, seed: int) -> torch.Tensor:
    """Batch entry 0 keeps about a quarter of its keys (at least one), the others about 70 %."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, N, generator=g) < 0.3
    mask[0] = torch.rand(N, generator=g) < 0.75
    mask[:, torch.randint(N, (1,), generator=g)] = False
    return mask


def random_alpha(B: int, H: int, seed: int, low: float = 0.5) -> torch.Tensor:
    return low + torch.rand(B, H, generator=torch.Generator().manual_seed(seed))


def assert_close_to_fp64(ours, ref64, ref32, *, grad=False, name="", magnitude=None):
    """FlashAttention's rule with the fp32 floor of the module docstring (the plain rule otherwise).

    ``magnitude`` replaces ``max|ref|`` in the floor for a result that is a cancelling sum.
    """
    if ours.dtype == torch.float32:
        floor = 1e-5 * max(1.0, float(ref64.abs().max()) if magnitude is None else magnitude)
        err = float((ours.double() - ref64).abs().max())
        bound = (3.0 if grad else 2.0) * float((ref32.double() - ref64).abs().max()) + floor
        assert not bool(torch.isnan(ours).any()), f"{name}: NaN"
        assert err <= bound, f"{name}: max|ours - ref| = {err:.3e} > {bound:.3e} (max|ref| {ref64.abs().max():.3e})"
    else:
        assert_within_flash_rule(ours, ref64, ref32, grad=grad, name=name)


def system64(k, mask, alpha):
    """``KᵀK + αI`` in fp64 over the valid keys."""
    gram, _ = statistics(k.double(), k.double()[..., :0], mask)
    return gram + alpha.double()[..., None, None] * torch.eye(k.shape[-1], dtype=F64)


def reference_outputs(q, k, v, mask, alpha, scale, dtype):
    """``(out, W)`` of the reference on the (already rounded) inputs, computed in ``dtype``."""
    q, k, v, alpha = (t.to(dtype) for t in (q, k, v, alpha))
    gram, cross = statistics(k, v, mask)
    eye = torch.eye(k.shape[-1], dtype=dtype)
    weights = torch.cholesky_solve(cross, torch.linalg.cholesky(gram + alpha[..., None, None] * eye))
    return intention_primal(q, k, v, alpha, mask, scale), weights


# ------------------------------------------------------------------------------------------- forward

FORWARD_CASES = [(D, N) for D in (8, 40, 64, 128) for N in (1, 7, 130)]


@pytest.mark.parametrize("D,N", FORWARD_CASES, ids=[f"D{D}-N{N}" for D, N in FORWARD_CASES])
def test_forward_fp32_matches_fp64_reference(D, N):
    B, H, M = 2, (1 if D == 128 else 2), 5
    # Non-contiguous inputs: views of [B, L, H, D] tensors (as from a projection) or every other column.
    layout = "transposed" if H > 1 and N > 1 and (D + N) % 2 else "strided_last"
    q, k, v = make_qkv(B, H, M, N, D, DV, layout=layout, seed=D * 1000 + N)
    mask = mask_with_sparse_entry(B, N, seed=N)
    alpha = random_alpha(B, H, seed=D)
    scale = D**-0.5
    out, factor, weights = intention_fwd_triton(q, k, v, mask, alpha, scale)
    assert out.dtype == torch.float32 and out.shape == (B, H, M, DV)
    assert factor.dtype == weights.dtype == torch.float32
    assert factor.shape == (B, H, D, D) and weights.shape == (B, H, D, DV)
    out64, weights64 = reference_outputs(q, k, v, mask, alpha, scale, F64)
    out32, weights32 = reference_outputs(q, k, v, mask, alpha, scale, torch.float32)
    assert_close_to_fp64(out, out64, out32, name="out")
    assert_close_to_fp64(weights, weights64, weights32, name="weights")


@pytest.mark.parametrize("D,N", [(8, 7), (40, 130), (128, 130)])
def test_factor_reproduces_regularised_gram(D, N):
    B, H = 2, 1
    q, k, v = make_qkv(B, H, 3, N, D, DV, seed=D + N)
    mask = mask_with_sparse_entry(B, N, seed=N + 1)
    alpha = random_alpha(B, H, seed=N)
    _, factor, _ = intention_fwd_triton(q, k, v, mask, alpha, 1.0)
    system = system64(k, mask, alpha)
    lower = factor.double().tril()
    assert bool((lower.diagonal(dim1=-2, dim2=-1) > 0).all())
    err = float((lower @ lower.transpose(-1, -2) - system).abs().max())
    assert err <= 1e-5 * float(system.abs().max()), f"|L Lᵀ - (KᵀK + αI)| = {err:.3e}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D,N", [(40, 130), (64, 7)])
def test_forward_half_precision_within_flash_rule(dtype, D, N):
    B, H, M = 2, 2, 6
    q, k, v = make_qkv(B, H, M, N, D, DV, dtype, layout="transposed", seed=D + N)
    mask = mask_with_sparse_entry(B, N, seed=N)
    alpha = random_alpha(B, H, seed=D)
    scale = D**-0.5
    out, _, weights = intention_fwd_triton(q, k, v, mask, alpha, scale)
    assert out.dtype == dtype and weights.dtype == torch.float32
    out64, _ = reference_outputs(q, k, v, mask, alpha, scale, F64)
    # PyTorch has no half-precision Cholesky: its best same-precision result is fp32 compute rounded.
    out32, _ = reference_outputs(q, k, v, mask, alpha, scale, torch.float32)
    assert_within_flash_rule(out, out64, out32.to(dtype), name=f"{dtype} out")


def test_padding_keys_are_never_read_and_fully_padded_entry_gives_zero():
    B, H, M, N, D = 3, 2, 4, 20, 16
    q, k, v = make_qkv(B, H, M, N, D, DV, seed=5)
    mask = mask_with_sparse_entry(B, N, seed=6)
    mask[2] = True
    alpha = random_alpha(B, H, seed=7)
    out, _, _ = intention_fwd_triton(q, k, v, mask, alpha, 0.5)
    poisoned_k = k.masked_fill(mask[:, None, :, None], float("nan"))
    poisoned_v = v.masked_fill(mask[:, None, :, None], float("inf"))
    poisoned, _, _ = intention_fwd_triton(q, poisoned_k, poisoned_v, mask, alpha, 0.5)
    assert torch.equal(poisoned, out)
    # No valid key: G = C = 0, so W = 0 for any α > 0.
    assert bool((out[2] == 0).all())


def test_broadcast_identity_queries_give_the_fitted_map():
    # attn_ext.intention_map runs the kernel on torch.eye(D).expand(B, H, D, D): queries with batch and
    # head strides 0. Each (batch, head) must still read the same identity and write its own map.
    B, H, N, D = 2, 3, 20, 6
    _, k, v = make_qkv(B, H, 1, N, D, 4, seed=8)
    mask = mask_with_sparse_entry(B, N, seed=9)
    alpha = random_alpha(B, H, seed=10)
    eye = torch.eye(D).expand(B, H, D, D)
    assert eye.stride()[:2] == (0, 0)
    out, _, _ = intention_fwd_triton(eye, k, v, mask, alpha, 1.0)
    gram, cross = statistics(k.double(), v.double(), mask)
    want = torch.linalg.solve(gram + alpha.double()[..., None, None] * torch.eye(D, dtype=F64), cross)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------- backward

BACKWARD_CASES = [(8, 7), (40, 130), (64, 1), (128, 130)]


@pytest.mark.parametrize("D,N", BACKWARD_CASES, ids=[f"D{D}-N{N}" for D, N in BACKWARD_CASES])
def test_backward_fp32_matches_fp64_autograd(D, N):
    B, H, M = 2, 1, 5
    q, k, v = make_qkv(B, H, M, N, D, DV, layout="padded_rows", seed=D + 7 * N)
    mask = mask_with_sparse_entry(B, N, seed=N + 3)
    alpha = random_alpha(B, H, seed=D + 1)
    scale = D**-0.5
    grad_out = torch.randn(B, H, M, DV, generator=torch.Generator().manual_seed(D))

    def autograd(dtype):
        leaves = [t.detach().to(dtype, copy=True).requires_grad_(True) for t in (q, k, v, alpha)]
        out = intention_primal(*leaves[:3], leaves[3], mask, scale)
        return torch.autograd.grad(out, leaves, grad_out.to(dtype))

    ref64, ref32 = autograd(F64), autograd(torch.float32)
    _, factor, weights = intention_fwd_triton(q, k, v, mask, alpha, scale)
    grads = intention_bwd_triton(grad_out, q, k, v, mask, factor, weights, scale)
    # dα = −Σ dB ⊙ W cancels heavily (Σ|dB ⊙ W| is often 100 x |dα|): the errors of dB and W scale with
    # the summands, not with the sum, and so does dα's floor.
    _, weights64 = reference_outputs(q, k, v, mask, alpha, scale, F64)
    rhs = scale * q.double().transpose(-1, -2) @ grad_out.double()
    grad_b64 = torch.cholesky_solve(rhs, torch.linalg.cholesky(system64(k, mask, alpha)))
    summands = float((grad_b64 * weights64).abs().sum((-1, -2)).max())
    for name, g, leaf, g64, g32 in zip(("dq", "dk", "dv", "dalpha"), grads, (q, k, v, alpha), ref64, ref32):
        assert g.dtype == torch.float32 and g.shape == leaf.shape, f"{name}: {g.dtype} {tuple(g.shape)}"
        assert_close_to_fp64(g, g64, g32, grad=True, name=name, magnitude=summands if name == "dalpha" else None)
    padded = mask[:, None, :, None].expand(B, H, N, 1)
    dk, dv = grads[1], grads[2]
    assert bool((dk.masked_select(padded) == 0).all()) and bool((dv.masked_select(padded) == 0).all())


def test_backward_half_precision_runs_in_input_dtype():
    B, H, M, N, D = 1, 2, 4, 9, 16
    q, k, v = make_qkv(B, H, M, N, D, DV, torch.bfloat16, seed=11)
    alpha = random_alpha(B, H, seed=12)
    _, factor, weights = intention_fwd_triton(q, k, v, None, alpha, 0.25)
    grad_out = torch.randn(B, H, M, DV, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)
    dq, dk, dv, dalpha = intention_bwd_triton(grad_out, q, k, v, None, factor, weights, 0.25)
    assert dq.dtype == dk.dtype == dv.dtype == torch.bfloat16 and dalpha.dtype == torch.float32
    leaves = [t.double().requires_grad_(True) for t in (q, k, v, alpha)]
    expected = torch.autograd.grad(intention_primal(*leaves, None, 0.25), leaves, grad_out.double())
    for name, g, g64 in zip(("dq", "dk", "dv", "dalpha"), (dq, dk, dv, dalpha), expected):
        torch.testing.assert_close(g.double(), g64, rtol=0.05, atol=0.05 * float(g64.abs().max()), msg=name)


# ------------------------------------------------------------------------------------------- errors

def test_alpha_zero_with_fewer_keys_than_dim_raises():
    q, k, v = make_qkv(1, 2, 3, 5, 16, DV, seed=21)
    with pytest.raises(RuntimeError, match=r"singular at \[batch, head\] = \[0, 0\]: alpha = 0 with 5 valid keys .* "
                                           r"use alpha > 0"):
        intention_fwd_triton(q, k, v, None, torch.zeros(1, 2), 1.0)


def test_alpha_zero_without_valid_keys_raises_for_that_head():
    q, k, v = make_qkv(2, 1, 3, 6, 8, 4, seed=22)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[1] = True
    alpha = torch.tensor([[0.5], [0.0]])
    with pytest.raises(RuntimeError, match=r"\[batch, head\] = \[1, 0\]: alpha = 0 with 0 valid keys for head dim D = 8"):
        intention_fwd_triton(q, k, v, mask, alpha, 1.0)


def test_unsupported_inputs_raise():
    q, k, v = make_qkv(1, 1, 2, 3, 8, 4, F64)
    with pytest.raises(TypeError, match="cpp"):
        intention_fwd_triton(q, k, v, None, torch.ones(1, 1), 1.0)
    q, k, v = make_qkv(1, 1, 2, 3, 129, 4)
    with pytest.raises(ValueError, match="D <= 128"):
        intention_fwd_triton(q, k, v, None, torch.ones(1, 1), 1.0)
    q, k, v = make_qkv(1, 1, 2, 3, 8, 4)
    with pytest.raises(ValueError, match="alpha"):
        intention_fwd_triton(q, k, v, None, torch.ones(1), 1.0)
    # The op takes the compiled op's schema, where v is optional (C = I); the Triton kernels need values.
    with pytest.raises(ValueError, match="attn_ext.intention: the Triton kernels need the values v"):
        torch.ops.attn_ext.intention_fwd_triton(q, k, None, None, torch.ones(1, 1), 1.0)
