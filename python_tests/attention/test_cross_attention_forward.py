"""Forward of ae.cross_attention (out and lse) on every backend vs fp64 ground truth (FlashAttention rule).

The cpp and reference backends get a broad grid; triton runs in the (slow) interpreter on CPU, so
it gets a small subset (fp32/fp16, small shapes, one long context). Cases of a backend that cannot
run are skipped with the reason ``ae.available_backends`` gives.
"""
import math

import pytest
import torch

import attn_ext as ae
from _helpers import (
    check_forward,
    check_forward_case,
    forward_case,
    make_mask,
    make_qkv,
    naive_attention,
    require_backend,
    run_backend,
)

CPU_BACKENDS = ("cpp", "reference")
CPU_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 40, 59, 64, 96, 128)
QK_SIZES = ((1, 1), (1, 239), (113, 203), (128, 4099))
FP32_FP16 = (torch.float32, torch.float16)


def _id(value):
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    return None


# ------------------------------------------------------------------------------------ cpp, reference
# The backend is the innermost parameter so that consecutive tests share a cached forward_case.


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("M,N", QK_SIZES, ids=str)
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=_id)
def test_forward_head_dims_and_sizes(dtype, D, M, N, backend):
    B, H = (2, 3) if N < 4000 else (1, 2)
    case = forward_case(B, H, M, N, D, dtype=dtype, seed=D + M + N)
    check_forward_case(backend, case, name=f"{backend} {dtype} D={D} M={M} N={N}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("D,Dv", [(16, 40), (64, 24), (59, 128), (96, 1), (40, 7), (1, 16)])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=_id)
def test_forward_value_dim_differs(dtype, D, Dv, backend):
    case = forward_case(2, 3, 113, 203, D, Dv, dtype=dtype, seed=D * Dv)
    check_forward_case(backend, case, name=f"{backend} D={D} Dv={Dv}")


MASK_KINDS = ("random", "lengths", "all_padded", "all_but_last")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("M,N", [(1, 239), (113, 203), (3, 4099)], ids=str)
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=_id)
def test_forward_masks(dtype, mask_kind, M, N, backend):
    # B=3, H=1: with few work units the cpp kernel splits the keys and merges partial states.
    case = forward_case(3, 1, M, N, 40, 24, dtype=dtype, mask_kind=mask_kind, seed=M + N)
    check_forward_case(backend, case, chunk_size=64 if N < 1000 else 512, name=f"{backend} mask={mask_kind}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_forward_fully_padded_entry_is_exactly_zero(backend):
    q, k, v = make_qkv(2, 2, 5, 300, 16, dtype=torch.float32)
    mask = torch.zeros(2, 300, dtype=torch.bool)
    mask[1] = True
    out, lse = run_backend(backend, q * 1e4, k, v, mask, chunk_size=32)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(lse[1], torch.full_like(lse[1], -math.inf))
    assert bool(torch.isfinite(out[0]).all()) and bool(torch.isfinite(lse[0]).all())


LAYOUTS = ("transposed", "padded_rows", "strided_last", "broadcast")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=_id)
def test_forward_non_contiguous_inputs(dtype, layout, backend):
    case = forward_case(2, 3, 113, 203, 40, 24, dtype=dtype, layout=layout, mask_kind="random", seed=7)
    out, _ = check_forward_case(backend, case, chunk_size=64, name=f"{backend} {layout}")
    assert out.is_contiguous()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("chunk_size", [1, 7, 64, 203, 512, 100000])
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=_id)
def test_forward_chunk_sizes(dtype, chunk_size, backend):
    case = forward_case(2, 3, 113, 203, 59, dtype=dtype, mask_kind="random", seed=11)
    check_forward_case(backend, case, chunk_size=chunk_size, name=f"{backend} chunk={chunk_size}")


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("B,H,M,N", [(1, 1, 1, 5000), (1, 1, 2, 5000), (1, 2, 1, 1031), (3, 1, 65, 700)])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=_id)
def test_forward_cpp_key_splits(dtype, B, H, M, N, masked):
    """Few (batch, head, query tile) units: the cpp kernel splits the keys and merges the partial
    states (docs/spec.md §1 merge), including splits whose keys are all padded."""
    q, k, v = make_qkv(B, H, M, N, 64, 32, dtype=dtype, seed=N)
    mask = None
    if masked:
        mask = torch.zeros(B, N, dtype=torch.bool)
        mask[:, : N // 2] = True  # the first half of the keys (whole splits) padded
        if B > 1:
            mask[-1] = True  # and a fully padded batch entry
    check_forward("cpp", q, k, v, mask, chunk_size=64, name=f"cpp splits mask={masked}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("scale", [0.0, 0.01, 0.3, 3.0])
def test_forward_explicit_scale(scale, backend):
    case = forward_case(2, 2, 17, 203, 40, mask_kind="random", scale=scale, seed=5)
    out, _ = check_forward_case(backend, case, chunk_size=64, name=f"scale={scale}")
    if scale == 0.0:  # uniform weights over the valid keys
        _, _, v, mask, _, _ = case
        valid = (~mask).to(v.dtype)
        mean = (v * valid[:, None, :, None]).sum(2) / valid.sum(1)[:, None, None]
        torch.testing.assert_close(out, mean[:, :, None].expand_as(out), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32), ids=_id)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_forward_large_scores_do_not_overflow(backend, dtype):
    """Scores of magnitude ~1e4: exp would overflow without the running max."""
    q, k, v = make_qkv(2, 2, 9, 300, 32, dtype=dtype, seed=2)
    check_forward(backend, q * 300.0, k, v, make_mask("random", 2, 300), chunk_size=32, name="large scores")


@pytest.mark.parametrize("M,N", [(0, 10), (4, 0), (0, 0)], ids=str)
@pytest.mark.parametrize("backend", ("cpp", "reference", "triton"))
def test_forward_empty_sizes(backend, M, N):
    """M = 0 gives empty outputs; N = 0 means no valid key: out 0, lse -inf (docs/spec.md §0)."""
    q, k, v = make_qkv(2, 1, M, N, 16, 8, dtype=torch.float32)
    require_backend(backend, q)
    out, lse = run_backend(backend, q, k, v, None)
    assert out.shape == (2, 1, M, 8) and lse.shape == (2, 1, M)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.full_like(lse, -math.inf))


def test_forward_default_backend_and_return_type():
    q, k, v = make_qkv(2, 2, 5, 33, 16, dtype=torch.float32)
    out = ae.cross_attention(q, k, v)
    assert isinstance(out, torch.Tensor)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    out2, lse = ae.cross_attention(q, k, v, return_lse=True)
    assert torch.equal(out, out2)
    torch.testing.assert_close(lse, naive_attention(q.double(), k.double(), v.double())[1].float())


def test_forward_backends_agree():
    q, k, v = make_qkv(2, 2, 33, 500, 40, 24, dtype=torch.float64, seed=4)
    mask = make_mask("all_padded", 2, 500)
    out_cpp, lse_cpp = run_backend("cpp", q, k, v, mask, chunk_size=64)
    out_ref, lse_ref = run_backend("reference", q, k, v, mask, chunk_size=128)
    torch.testing.assert_close(out_cpp, out_ref, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(lse_cpp, lse_ref, rtol=1e-12, atol=1e-13)


# ------------------------------------------------------------------------------------ triton (subset)


@pytest.mark.parametrize("M,N", [(1, 1), (1, 239), (113, 203)], ids=str)
@pytest.mark.parametrize("D", (16, 40, 59))
@pytest.mark.parametrize("dtype", FP32_FP16, ids=_id)
def test_triton_forward_head_dims_and_sizes(dtype, D, M, N):
    B, H = (2, 2) if M * N < 10000 else (1, 2)
    q, k, v = make_qkv(B, H, M, N, D, dtype=dtype, seed=D + M + N)
    check_forward("triton", q, k, v, name=f"triton {dtype} D={D} M={M} N={N}")


def test_triton_forward_long_context():
    q, k, v = make_qkv(1, 1, 128, 4099, 64, dtype=torch.float32, seed=9)
    check_forward("triton", q, k, v, make_mask("lengths", 1, 4099), name="triton N=4099")


@pytest.mark.parametrize("D,Dv", [(16, 40), (59, 24)])
def test_triton_forward_value_dim_differs(D, Dv):
    q, k, v = make_qkv(2, 1, 33, 203, D, Dv, dtype=torch.float32, seed=D)
    check_forward("triton", q, k, v, name=f"triton D={D} Dv={Dv}")


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("dtype", FP32_FP16, ids=_id)
def test_triton_forward_masks(dtype, mask_kind):
    q, k, v = make_qkv(3, 1, 17, 203, 40, 24, dtype=dtype, seed=3)
    check_forward("triton", q, k, v, make_mask(mask_kind, 3, 203), chunk_size=64, name=f"triton {mask_kind}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_forward_non_contiguous_inputs(layout):
    q, k, v = make_qkv(2, 2, 17, 203, 40, 24, dtype=torch.float32, layout=layout, seed=7)
    check_forward("triton", q, k, v, make_mask("random", 2, 203), name=f"triton {layout}")


@pytest.mark.parametrize("chunk_size", [7, 64, 512])
def test_triton_forward_chunk_size_hint(chunk_size):
    q, k, v = make_qkv(1, 2, 17, 203, 40, dtype=torch.float32, seed=12)
    check_forward("triton", q, k, v, make_mask("random", 1, 203), chunk_size=chunk_size, name="triton chunk")
