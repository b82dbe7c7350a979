"""Gradients of ae.cross_attention through out AND lse vs fp64 autograd (FlashAttention 3x rule),
zero gradients for padding, and fp64 gradcheck of the cpp and reference backends.

Triton runs in the interpreter on CPU, so it gets a small subset.
"""
import pytest
import torch

import attn_ext as ae
from _helpers import backward_case, check_backward_case, make_mask, make_qkv, naive_attention, require_backend

CPU_BACKENDS = ("cpp", "reference")
LOW_AND_SINGLE = (torch.float32, torch.float16, torch.bfloat16)


def _id(value):
    return str(value).replace("torch.", "") if isinstance(value, torch.dtype) else None


# ------------------------------------------------------------------------------------ cpp, reference


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("M,N", [(1, 1), (1, 239), (113, 203)], ids=str)
@pytest.mark.parametrize("D", (16, 59, 128))
@pytest.mark.parametrize("dtype", LOW_AND_SINGLE, ids=_id)
def test_backward_head_dims_and_sizes(dtype, D, M, N, backend):
    case = backward_case(2, 3, M, N, D, dtype=dtype, seed=D + M + N)
    check_backward_case(backend, case, name=f"{backend} {dtype} D={D} M={M} N={N}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=_id)
def test_backward_long_context(dtype, backend):
    case = backward_case(1, 2, 128, 4099, 64, 40, dtype=dtype, mask_kind="lengths", seed=3)
    check_backward_case(backend, case, name=f"{backend} {dtype} N=4099")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("D,Dv", [(16, 40), (59, 128), (96, 1)])
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=_id)
def test_backward_value_dim_differs(dtype, D, Dv, backend):
    case = backward_case(2, 3, 33, 203, D, Dv, dtype=dtype, seed=D * Dv)
    check_backward_case(backend, case, name=f"{backend} D={D} Dv={Dv}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mask_kind", ("random", "lengths", "all_padded", "all_but_last"))
@pytest.mark.parametrize("dtype", LOW_AND_SINGLE, ids=_id)
def test_backward_masks(dtype, mask_kind, backend):
    case = backward_case(3, 2, 17, 203, 40, 24, dtype=dtype, mask_kind=mask_kind, seed=4)
    check_backward_case(backend, case, chunk_size=64, name=f"{backend} {mask_kind}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("layout", ("transposed", "padded_rows", "strided_last", "broadcast"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=_id)
def test_backward_non_contiguous_inputs(dtype, layout, backend):
    case = backward_case(2, 3, 33, 203, 40, 24, dtype=dtype, layout=layout, mask_kind="random", seed=7)
    check_backward_case(backend, case, chunk_size=64, name=f"{backend} {layout}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("chunk_size", [7, 64, 203, 512])
def test_backward_chunk_sizes(chunk_size, backend):
    case = backward_case(2, 2, 33, 203, 59, mask_kind="random", seed=11)
    check_backward_case(backend, case, chunk_size=chunk_size, name=f"{backend} chunk={chunk_size}")


@pytest.mark.parametrize("B,H,M,N", [(1, 1, 1, 5000), (1, 1, 3, 2000), (2, 1, 1, 1031)])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=_id)
def test_backward_cpp_key_splits(dtype, B, H, M, N):
    """Few (batch, head) units: the cpp backward splits the keys and sums partial dq."""
    case = backward_case(B, H, M, N, 64, 32, dtype=dtype, mask_kind="random" if B > 1 else "none", seed=N)
    check_backward_case("cpp", case, chunk_size=64, name=f"cpp splits {dtype}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("which", ["out", "lse"])
def test_backward_through_one_output_only(which, backend):
    """Only out (or only lse) used: the other upstream gradient is None inside autograd."""
    q, k, v = (t.requires_grad_(True) for t in make_qkv(2, 2, 9, 70, 16, dtype=torch.float64))
    mask = make_mask("all_padded", 2, 70)
    out, lse = ae.cross_attention(q, k, v, key_padding_mask=mask, return_lse=True, backend=backend, chunk_size=16)
    loss = (out * out).sum() if which == "out" else torch.where(torch.isinf(lse), 0.0, lse).sum()
    grads = torch.autograd.grad(loss, (q, k, v))  # v does not influence lse: its gradient is 0
    q64, k64, v64 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out64, lse64 = naive_attention(q64, k64, v64, mask)
    loss64 = (out64 * out64).sum() if which == "out" else torch.where(torch.isinf(lse64), 0.0, lse64).sum()
    expected = torch.autograd.grad(loss64, (q64, k64, v64), allow_unused=True, materialize_grads=True)
    for g, e in zip(grads, expected):
        assert not bool(torch.isnan(g).any())
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------ gradcheck (fp64)


def _attention_for_gradcheck(backend, mask, chunk_size, scale):
    def f(q, k, v):
        out, lse = ae.cross_attention(
            q, k, v, key_padding_mask=mask, chunk_size=chunk_size, scale=scale, return_lse=True, backend=backend
        )
        # lse = -inf for fully padded rows is constant; finite differences of it would be NaN.
        return out, torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)

    return f


def _gradcheck_mask(kind, B, N):
    if kind == "none":
        return None
    mask = torch.zeros(B, N, dtype=torch.bool)
    mask[:, 1] = True
    mask[:, -2] = True
    if kind == "all_padded":
        mask[-1] = True
    return mask


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mask_kind", ["none", "some", "all_padded"])
@pytest.mark.parametrize("N", [5, 9])
def test_gradcheck(N, mask_kind, backend):
    B = 2 if mask_kind == "all_padded" else 1
    gen = torch.Generator().manual_seed(N)
    q = torch.randn(B, 2, 3, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(B, 2, N, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(B, 2, N, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    require_backend(backend, q)
    f = _attention_for_gradcheck(backend, _gradcheck_mask(mask_kind, B, N), chunk_size=2, scale=None)
    assert torch.autograd.gradcheck(f, (q, k, v), check_batched_grad=False)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gradcheck_non_contiguous_and_scaled(backend):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 3, 2, 4, dtype=torch.float64, generator=gen).transpose(1, 2).requires_grad_(True)
    k = torch.randn(1, 7, 2, 4, dtype=torch.float64, generator=gen).transpose(1, 2).requires_grad_(True)
    v = torch.randn(1, 2, 7, 6, dtype=torch.float64, generator=gen)[..., ::2].requires_grad_(True)
    f = _attention_for_gradcheck(backend, None, chunk_size=3, scale=0.7)
    assert torch.autograd.gradcheck(f, (q, k, v), check_batched_grad=False)


# ------------------------------------------------------------------------------------ triton (subset)


@pytest.mark.parametrize("M,N", [(1, 239), (113, 203)], ids=str)
@pytest.mark.parametrize("D", (16, 59))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=_id)
def test_triton_backward(dtype, D, M, N):
    case = backward_case(2, 1, M, N, D, dtype=dtype, seed=D + M + N)
    check_backward_case("triton", case, name=f"triton {dtype} D={D} M={M} N={N}")


@pytest.mark.parametrize("mask_kind", ("random", "all_padded"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=_id)
def test_triton_backward_masks(dtype, mask_kind):
    case = backward_case(3, 1, 17, 203, 40, 24, dtype=dtype, mask_kind=mask_kind, seed=4)
    check_backward_case("triton", case, chunk_size=64, name=f"triton {mask_kind}")


def test_triton_backward_non_contiguous():
    case = backward_case(2, 2, 17, 203, 40, 24, layout="transposed", mask_kind="random", seed=7)
    check_backward_case("triton", case, chunk_size=32, name="triton transposed")


def test_triton_backward_single_key():
    case = backward_case(1, 1, 1, 1, 16, 8, seed=0)
    check_backward_case("triton", case, name="triton M=N=1")
