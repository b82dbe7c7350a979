"""Bad inputs raise clear errors naming the shapes/dtypes (docs/spec.md §0), through the public API and
through direct calls of the C++ ops (csrc/checks/attention_checks.h). Nothing is silently broadcast."""
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

import attn_ext as ae
from _helpers import make_qkv, require_backend

B, H, M, N, D, DV = 2, 3, 4, 6, 8, 5


def _qkv(dtype=torch.float32):
    return make_qkv(B, H, M, N, D, DV, dtype=dtype)


def _mask(*shape, dtype=torch.bool, device="cpu"):
    return torch.zeros(*shape, dtype=dtype, device=device)


def _bad_inputs():
    """(id, kwargs overriding q/k/v/key_padding_mask, exception, message regex) for the public API."""
    q, k, v = _qkv()
    return [
        ("q_rank3", dict(q=q[0]), ValueError, r"q, k, v must be 4-D .* got q \(3, 4, 8\)"),
        ("k_rank5", dict(k=k[None]), ValueError, r"must be 4-D .*k \(1, 2, 3, 6, 8\)"),
        ("v_rank2", dict(v=v[0, 0]), ValueError, r"must be 4-D .*v \(6, 5\)"),
        ("batch_mismatch", dict(k=k[:1]), ValueError, r"batch and head sizes of q \(2, 3, 4, 8\), k \(1, 3, 6, 8\)"),
        ("heads_mismatch", dict(v=v[:, :2]), ValueError, r"batch and head sizes .* v \(2, 2, 6, 5\) must match"),
        ("broadcastable_batch_not_broadcast", dict(q=q[:1]), ValueError, r"batch and head sizes of q \(1, 3, 4, 8\)"),
        ("head_dim_mismatch", dict(q=q[..., :7]), ValueError, r"q \(2, 3, 4, 7\) and k \(2, 3, 6, 8\) must have the same head dim D"),
        ("zero_head_dim", dict(q=q[..., :0], k=k[..., :0]), ValueError, r"head dim D must be positive"),
        ("key_count_mismatch", dict(v=v[:, :, :5]), ValueError, r"k \(2, 3, 6, 8\) and v \(2, 3, 5, 5\) must have the same number of keys N"),
        ("dtype_mismatch", dict(k=k.double()), TypeError, r"q, k, v must share a dtype; got torch.float32, torch.float64, torch.float32"),
        ("int_dtype", dict(q=q.int(), k=k.int(), v=v.int()), TypeError, r"dtype torch.int32 is not supported"),
        ("complex_dtype", dict(q=q.cfloat(), k=k.cfloat(), v=v.cfloat()), TypeError, r"dtype torch.complex64 is not supported"),
        ("mask_not_tensor", dict(key_padding_mask=[[False] * N] * B), TypeError, r"key_padding_mask must be a bool tensor, got list"),
        ("mask_float", dict(key_padding_mask=_mask(B, N, dtype=torch.float32)), TypeError, r"key_padding_mask must be bool \(True = padding, ignored\), got torch.float32"),
        ("mask_uint8", dict(key_padding_mask=_mask(B, N, dtype=torch.uint8)), TypeError, r"must be bool .* got torch.uint8"),
        ("mask_wrong_n", dict(key_padding_mask=_mask(B, N - 1)), ValueError, r"key_padding_mask must be \[B, N\] = \[2, 6\] for k \(2, 3, 6, 8\), got \[2, 5\]"),
        ("mask_missing_batch", dict(key_padding_mask=_mask(N)), ValueError, r"must be \[B, N\] = \[2, 6\] .* got \[6\]"),
        ("mask_broadcastable_batch", dict(key_padding_mask=_mask(1, N)), ValueError, r"must be \[B, N\] = \[2, 6\] .* got \[1, 6\]"),
        ("mask_per_head", dict(key_padding_mask=_mask(B, H, N)), ValueError, r"got \[2, 3, 6\]"),
        ("mask_on_other_device", dict(key_padding_mask=_mask(B, N, device="meta")), RuntimeError, r"key_padding_mask is on meta but k is on cpu"),
        ("qkv_on_other_devices", dict(k=torch.empty(B, H, N, D, device="meta")), RuntimeError, r"q, k, v must be on one device; got cpu, meta, cpu"),
        ("q_not_tensor", dict(q=q.tolist()), TypeError, r"q must be a torch.Tensor, got list"),
    ]


BAD_INPUTS = _bad_inputs()


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
@pytest.mark.parametrize("backend", [None, "cpp", "reference", "triton"])
def test_public_api_rejects_bad_inputs(backend, case):
    _, overrides, exception, pattern = case
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v, key_padding_mask=None)
    args.update(overrides)
    with pytest.raises(exception, match=r"^attn_ext\.cross_attention: .*" + pattern):
        ae.cross_attention(args["q"], args["k"], args["v"], key_padding_mask=args["key_padding_mask"], backend=backend)


@pytest.mark.parametrize("chunk_size", [0, -1, -512, 2.5, True, "64"])
def test_bad_chunk_size(chunk_size):
    q, k, v = _qkv()
    with pytest.raises(ValueError,
                       match=rf"^attn_ext\.cross_attention: chunk_size must be a positive int, got {chunk_size!r}"):
        ae.cross_attention(q, k, v, chunk_size=chunk_size)


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf, "0.5", None, 1j])
def test_bad_scale(scale):
    q, k, v = _qkv()
    if scale is None:  # None means the default 1/sqrt(D): accepted
        ae.cross_attention(q, k, v, scale=scale)
        return
    with pytest.raises(ValueError, match=r"^attn_ext\.cross_attention: scale must be a finite float, got "):
        ae.cross_attention(q, k, v, scale=scale)


def test_mask_on_cuda_when_inputs_on_cpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the cross-device mask case is covered with the meta device instead")
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match=r"key_padding_mask is on cuda:0 but k is on cpu"):
        ae.cross_attention(q, k, v, key_padding_mask=_mask(B, N, device="cuda"))


def test_triton_rejects_float64():
    q, k, v = _qkv(torch.float64)
    with pytest.raises(RuntimeError, match=r"backend 'triton' cannot run on cpu torch.float64 inputs"):
        ae.cross_attention(q, k, v, backend="triton")


# ----------------------------------------------------------------------- direct calls of the C++ ops


@pytest.fixture
def cpp_fwd():
    require_backend("cpp", _qkv()[0])
    return torch.ops.attn_ext.cross_attention_fwd


def _direct_bad_inputs():
    q, k, v = _qkv()
    return [
        ("q_rank3", (q[0], k, v, None), ValueError, r"q, k, v must be 4-D \[B, H, M, D\], \[B, H, N, D\], \[B, H, N, Dv\]; got q \[3, 4, 8\]"),
        ("batch_mismatch", (q, k[:1], v, None), ValueError, r"batch and head sizes of q \[2, 3, 4, 8\], k \[1, 3, 6, 8\]"),
        ("heads_mismatch", (q, k, v[:, :1], None), ValueError, r"batch and head sizes .* v \[2, 1, 6, 5\] must match"),
        ("head_dim_mismatch", (q[..., :7], k, v, None), ValueError, r"q \[2, 3, 4, 7\] and k \[2, 3, 6, 8\] must have the same head dim D"),
        ("key_count_mismatch", (q, k, v[:, :, :5], None), ValueError, r"k \[2, 3, 6, 8\] and v \[2, 3, 5, 5\] must have the same number of keys N"),
        ("dtype_mismatch", (q, k.double(), v, None), TypeError, r"q, k, v must share a dtype; got Float, Double, Float"),
        ("mask_int64", (q, k, v, _mask(B, N, dtype=torch.int64)), TypeError, r"key_padding_mask must be bool \(True = padding\), got Long"),
        ("mask_wrong_shape", (q, k, v, _mask(B, N - 1)), ValueError, r"key_padding_mask must be \[B, N\] = \[2, 6\], got \[2, 5\]"),
        ("mask_rank1", (q, k, v, _mask(N)), ValueError, r"key_padding_mask must be \[B, N\] = \[2, 6\], got \[6\]"),
    ]


DIRECT_BAD = _direct_bad_inputs()


@pytest.mark.parametrize("case", DIRECT_BAD, ids=[c[0] for c in DIRECT_BAD])
def test_cpp_forward_op_checks(cpp_fwd, case):
    _, tensors, exception, pattern = case
    with pytest.raises(exception, match=r"^attn_ext: .*" + pattern):
        cpp_fwd(*tensors, 0.5, 4)


@pytest.mark.parametrize("chunk_size", [0, -3])
def test_cpp_forward_op_rejects_non_positive_chunk_size(cpp_fwd, chunk_size):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=rf"^attn_ext: chunk_size must be positive, got {chunk_size}"):
        cpp_fwd(q, k, v, None, 0.5, chunk_size)


def test_cpp_forward_op_rejects_unsupported_dtype(cpp_fwd):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"^attn_ext: .*Int"):
        cpp_fwd(q.int(), k.int(), v.int(), None, 0.5, 4)


@pytest.mark.parametrize("scale", [math.nan, math.inf])
def test_cpp_forward_op_rejects_non_finite_scale(cpp_fwd, scale):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^attn_ext: .*scale"):
        cpp_fwd(q, k, v, None, scale, 4)


def _backward_args(**overrides):
    q, k, v = _qkv()
    out, lse = torch.ops.attn_ext.cross_attention_fwd(q, k, v, None, 0.5, 4)
    args = dict(grad_out=torch.randn_like(out), grad_lse=torch.randn_like(lse), q=q, k=k, v=v, mask=None,
                out=out, lse=lse)
    args.update(overrides)
    return tuple(args.values()) + (0.5, 4)


@pytest.mark.parametrize(
    "overrides,exception,pattern",
    [
        (dict(grad_out=torch.zeros(B, H, M, DV - 1)), ValueError, r"out \[2, 3, 4, 5\] and grad_out \[2, 3, 4, 4\] must be \[2, 3, 4, 5\]"),
        (dict(out=torch.zeros(B, H, M + 1, DV)), ValueError, r"out \[2, 3, 5, 5\] and grad_out \[2, 3, 4, 5\] must be \[2, 3, 4, 5\]"),
        (dict(grad_lse=torch.zeros(B, H, M + 1)), ValueError, r"lse \[2, 3, 4\] and grad_lse \[2, 3, 5\] must be \[2, 3, 4\]"),
        (dict(grad_lse=torch.zeros(B, H, M, dtype=torch.float64)), TypeError, r"lse and grad_lse must be Float for Float inputs; got Float and Double"),
        (dict(grad_out=torch.zeros(B, H, M, DV, dtype=torch.float16)), TypeError, r"out and grad_out must have q's dtype Float"),
        (dict(k=torch.zeros(B, H, N, D + 1)), ValueError, r"must have the same head dim D"),
    ],
    ids=["grad_out_shape", "out_shape", "grad_lse_shape", "grad_lse_dtype", "grad_out_dtype", "k_head_dim"],
)
def test_cpp_backward_op_checks(cpp_fwd, overrides, exception, pattern):
    with pytest.raises(exception, match=r"^attn_ext: .*" + pattern):
        torch.ops.attn_ext.cross_attention_bwd(*_backward_args(**overrides))


def test_cuda_backend_on_cpu_tensors_says_why():
    q = torch.randn(1, 1, 2, 4)
    assert ae.available_backends(q)["cuda"] is not None
    with pytest.raises(RuntimeError, match=r"backend 'cuda' cannot run.*cuda: the CUDA kernels run on CUDA tensors"):
        ae.cross_attention(q, q, q, backend="cuda")
    with pytest.raises(RuntimeError, match=r"attn_ext.tree_aggregate: backend 'cuda' cannot run on cpu.*cuda: the CUDA kernels run on CUDA"):
        tree = ae.build_tree(torch.rand(1, 8, 1))
        ae.tree_aggregate(tree, torch.randn(1, 8, 3), backend="cuda")


# ----------------------------------------------------------------------- NumPy and other scalar types

REAL_SCALES = [np.float32(0.3), np.float64(0.3), np.float16(0.3), np.int64(2), Fraction(1, 3)]
INT_CHUNKS = [np.int64(4), np.int32(4), np.uint8(4)]


@pytest.mark.parametrize("backend", ["cpp", "reference", "triton"])
def test_numpy_scalars_give_the_python_number_result(backend):
    """Any real scalar is a scale and any integer scalar a chunk size, as for SDPA: the result is that
    of the equal Python number, bit for bit."""
    q, k, v = _qkv()
    require_backend(backend, q)
    for scale in REAL_SCALES:
        expected = ae.cross_attention(q, k, v, scale=float(scale), backend=backend)
        assert torch.equal(ae.cross_attention(q, k, v, scale=scale, backend=backend), expected), repr(scale)
    for chunk in INT_CHUNKS:
        expected = ae.cross_attention(q, k, v, chunk_size=int(chunk), backend=backend, return_lse=True)
        got = ae.cross_attention(q, k, v, chunk_size=chunk, backend=backend, return_lse=True)
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), repr(chunk)


def test_numpy_scalars_in_the_state_api():
    q, k, v = _qkv()
    scale, chunk = np.float32(0.25), np.int64(2)
    state = ae.attention_state(q, k[:, :, :3], v[:, :, :3], scale=scale, chunk_size=chunk)
    state = ae.update_state(state, q, k[:, :, 3:], v[:, :, 3:], scale=scale, chunk_size=chunk)
    streamed = ae.stream_attention(q, iter([(k[:, :, :3], v[:, :, :3]), (k[:, :, 3:], v[:, :, 3:])]), scale=scale,
                                   chunk_size=chunk)
    expected = ae.cross_attention(q, k, v, scale=0.25, return_lse=True)
    for got in (state, streamed):
        torch.testing.assert_close(got.out, expected[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got.lse, expected[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [np.bool_(True), False, np.float64(4.0), np.int64(0), np.int64(-2)])
def test_bools_floats_and_non_positive_numpy_chunk_sizes_are_rejected(chunk_size):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^attn_ext\.cross_attention: chunk_size must be a positive int, got "):
        ae.cross_attention(q, k, v, chunk_size=chunk_size)


@pytest.mark.parametrize("scale", [True, np.bool_(True), np.float32("nan"), np.float64("inf"), torch.tensor(0.5)])
def test_bool_non_finite_and_tensor_scales_are_rejected(scale):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^attn_ext\.cross_attention: scale must be a finite float, got "):
        ae.cross_attention(q, k, v, scale=scale)
