"""attn_ext.batched_cholesky / batched_cholesky_solve against torch.linalg (docs/spec.md §4).

fp64 results must match torch's to a few ulps of the data; fp32 results must be within twice the
error of torch's own fp32 computation against the fp64 result (plus a floor of a few ulps), the rule
the attention tests use too. Sizes straddle the kernels' 6-row blocks and 16-float / 8-double vectors.
"""
import math

import pytest
import torch

from attn_ext.ops.intention import batched_cholesky, batched_cholesky_solve
from _matrices import assert_as_accurate_as_torch, ill_conditioned, indefinite_at, rhs, spd

NS = (1, 2, 7, 8, 40, 59, 64, 96, 128, 200)
RS = (1, 3, 64)
BATCH_SHAPES = ((), (5,), (2, 3))
DTYPES = (torch.float32, torch.float64)
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("batch_shape", BATCH_SHAPES, ids=str)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_factor_matches_torch(dtype, n, batch_shape):
    a64 = spd(batch_shape, n)
    a = a64.to(dtype)
    L, info = batched_cholesky(a)
    assert L.shape == a.shape and L.dtype == dtype and L.is_contiguous()
    assert info.shape == batch_shape and info.dtype == torch.int32 and (info == 0).all()
    assert torch.equal(L, L.tril()), "L must be zero above the diagonal"
    # fp64 has no more exact reference than torch's own fp64 result: allow rounding of order n ulps.
    truth = torch.linalg.cholesky(a.double())
    assert_as_accurate_as_torch(L, torch.linalg.cholesky(a), truth, "L", floor_ulps=4 if dtype == torch.float32 else 4 * n)


@pytest.mark.parametrize("batch_shape", BATCH_SHAPES, ids=str)
@pytest.mark.parametrize("r", RS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_solve_matches_torch(dtype, n, r, batch_shape):
    L = torch.linalg.cholesky(spd(batch_shape, n, dtype))
    b = rhs(batch_shape, n, r, dtype)
    x = batched_cholesky_solve(L, b)
    assert x.shape == b.shape and x.dtype == dtype and x.is_contiguous()
    truth = torch.cholesky_solve(b.double(), L.double())  # the same factor, solved in fp64
    assert_as_accurate_as_torch(x, torch.cholesky_solve(b, L), truth, "X", floor_ulps=4 if dtype == torch.float32 else 4 * n)


@pytest.mark.parametrize("dtype, condition", [(torch.float64, 1e10), (torch.float32, 1e4)], ids=str)
@pytest.mark.parametrize("n", (8, 40, 64, 128))
def test_ill_conditioned_spd(dtype, condition, n):
    a = ill_conditioned((4,), n, condition, dtype)
    L, info = batched_cholesky(a)
    L_torch, info_torch = torch.linalg.cholesky_ex(a)
    assert (info == 0).all() and (info_torch == 0).all()
    # Backward errors ‖L Lᵀ − A‖ and ‖A X − B‖: what a stable factorisation guarantees at any condition.
    a64 = a.double()
    assert_as_accurate_as_torch(L.double() @ L.double().mT, L_torch.double() @ L_torch.double().mT, a64, "L Lᵀ",
                                floor_ulps=4 * n)
    b = rhs((4,), n, 3, dtype)
    x, x_torch = batched_cholesky_solve(L, b), torch.cholesky_solve(b, L_torch)

    def backward_error(x):  # ‖A X − B‖ / (‖A‖‖X‖ + ‖B‖): X is of order the condition number here
        x = x.double()
        return ((a64 @ x - b.double()).abs().max() / (a64.abs().max() * x.abs().max() + b.abs().max())).item()

    eps = torch.finfo(dtype).eps
    assert backward_error(x) <= 2 * backward_error(x_torch) + 4 * n * eps


@pytest.mark.parametrize("n, j", [(1, 0), (7, 0), (7, 6), (40, 5), (40, 6), (64, 33), (128, 127), (200, 150)])
def test_not_positive_definite_reports_the_column(n, j):
    spd_one = spd((), n)
    a = torch.stack([spd_one, indefinite_at(n, j), spd_one])
    for dtype in DTYPES:
        L, info = batched_cholesky(a.to(dtype))
        _, info_torch = torch.linalg.cholesky_ex(a.to(dtype))
        assert info.tolist() == [0, j + 1, 0] == info_torch.tolist()
        # The failed matrix keeps the factor's first j columns and zeros after them.
        leading = a[1, :j, :j]
        assert_as_accurate_as_torch(L[1, :j, :j], torch.linalg.cholesky(leading.to(dtype)),
                                    torch.linalg.cholesky(leading), "partial L", floor_ulps=4 * n)
        assert (L[1, :, j:] == 0).all()
        assert torch.equal(L[0], L[2]), "a failure must not leak into the other matrices"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_and_inf_give_nonzero_info(dtype):
    n = 20
    a = spd((4,), n, dtype)
    a[0, 11, 3] = math.nan  # lower triangle: row 11's pivot becomes NaN
    a[1, 0, 0] = math.nan
    a[2, 5, 5] = math.inf
    a[3, 2, 15] = math.nan  # upper triangle: never read
    L, info = batched_cholesky(a)
    assert info.tolist() == [12, 1, 6, 0]
    assert not torch.isnan(L[3]).any()
    assert torch.allclose(L[3], torch.linalg.cholesky(a[3].tril() + a[3].tril(-1).mT))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_only_the_lower_triangle_is_read(dtype):
    a = spd((3,), 23, dtype)
    garbage = torch.triu(torch.randn(3, 23, 23, dtype=dtype), diagonal=1) * 1e6
    L, _ = batched_cholesky(a.tril() + garbage)
    assert torch.allclose(L, torch.linalg.cholesky(a), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_inputs(dtype):
    n, r = 37, 5
    base = spd((6,), n, dtype)
    garbage_lower = torch.tril(torch.full_like(base, 1e6), diagonal=-1)
    views = {
        # Column-major storage whose lower triangle (as a view) is base's and whose upper one is garbage.
        "transposed": (base.triu() + garbage_lower).mT,
        "batch step": base[::2],
        "expanded batch": base[:1].expand(4, n, n),
        "strided rows and columns": torch.zeros(6, 2 * n, 2 * n, dtype=dtype)[:, ::2, ::2].copy_(base),
    }
    for name, a in views.items():
        L, info = batched_cholesky(a)
        assert (info == 0).all(), name
        assert torch.allclose(L, torch.linalg.cholesky(a.tril() + a.tril(-1).mT), rtol=1e-5, atol=1e-6), name
    L = torch.linalg.cholesky(base)
    b = rhs((6,), n, 2 * r, dtype)
    for name, (l_view, b_view) in {
        "B column step": (L, b[..., ::2]),
        "B transposed": (L, b[..., :r].mT.contiguous().mT),
        "L transposed storage": (L.mT.contiguous().mT, b[..., :r]),
        "L batch step": (L[::2], b[::2, :, :r]),
    }.items():
        x = batched_cholesky_solve(l_view, b_view)
        assert torch.allclose(x, torch.cholesky_solve(b_view, l_view), rtol=1e-4, atol=1e-5), name


def test_many_matrices_split_across_threads():
    # Enough matrices for several at::parallel_for chunks, each streaming (and prefetching) a range.
    a = spd((700,), 16, torch.float32)
    b = rhs((700,), 16, 16, torch.float32)
    L, info = batched_cholesky(a)
    assert (info == 0).all()
    assert torch.allclose(L, torch.linalg.cholesky(a), rtol=1e-5, atol=1e-6)
    assert torch.allclose(batched_cholesky_solve(L, b), torch.cholesky_solve(b, L), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("isa", ("avx2", "baseline"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_narrower_instruction_sets(monkeypatch, isa, dtype):
    # The kernels are compiled per ISA with its own vector and panel widths; ATTN_EXT_CPU_ISA makes
    # this machine run the narrower ones too.
    monkeypatch.setenv("ATTN_EXT_CPU_ISA", isa)
    for n, r in ((7, 3), (40, 64), (59, 1), (130, 16)):
        a = spd((3,), n, dtype)
        L, info = batched_cholesky(a)
        assert (info == 0).all()
        assert_as_accurate_as_torch(L, torch.linalg.cholesky(a), torch.linalg.cholesky(a.double()), "L",
                                    floor_ulps=4 if dtype == torch.float32 else 4 * n)
        b = rhs((3,), n, r, dtype)
        x = batched_cholesky_solve(L, b)
        assert_as_accurate_as_torch(x, torch.cholesky_solve(b, L), torch.cholesky_solve(b.double(), L.double()), "X",
                                    floor_ulps=4 if dtype == torch.float32 else 4 * n)
    _, info = batched_cholesky(torch.stack([spd((), 40, dtype), indefinite_at(40, 17).to(dtype)]))
    assert info.tolist() == [0, 18]


def test_empty_shapes():
    L, info = batched_cholesky(torch.empty(0, 4, 4))
    assert L.shape == (0, 4, 4) and info.shape == (0,)
    L, info = batched_cholesky(torch.empty(3, 0, 0, dtype=torch.float64))
    assert L.shape == (3, 0, 0) and info.tolist() == [0, 0, 0]
    assert batched_cholesky_solve(torch.eye(4).expand(2, 4, 4), torch.empty(2, 4, 0)).shape == (2, 4, 0)
    assert batched_cholesky_solve(torch.empty(2, 0, 0), torch.empty(2, 0, 3)).shape == (2, 0, 3)


def test_meta_tensors_use_the_fake_kernels():
    a = torch.empty(2, 3, 5, 5, device="meta", dtype=torch.float64)
    L, info = batched_cholesky(a)
    assert L.device.type == "meta" and L.shape == a.shape and L.dtype == torch.float64
    assert info.shape == (2, 3) and info.dtype == torch.int32
    x = batched_cholesky_solve(L, torch.empty(2, 3, 5, 7, device="meta", dtype=torch.float64))
    assert x.device.type == "meta" and x.shape == (2, 3, 5, 7)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck(dtype):
    a = spd((2, 3), 9, dtype)
    torch.library.opcheck(torch.ops.attn_ext.batched_cholesky, (a,), test_utils=OPCHECK_TESTS)
    L = torch.linalg.cholesky(a)
    torch.library.opcheck(torch.ops.attn_ext.batched_cholesky_solve, (L, rhs((2, 3), 9, 4, dtype)),
                          test_utils=OPCHECK_TESTS)


def test_backward_raises_a_clear_error():
    # Refused where the graph would start (not at backward time, and never a warning with zero gradients).
    a = spd((2,), 4).requires_grad_()
    with pytest.raises(RuntimeError, match="batched_cholesky is not differentiable"):
        batched_cholesky(a)
    L, _ = batched_cholesky(a.detach())
    b = rhs((2,), 4, 3, torch.float64).requires_grad_()
    with pytest.raises(RuntimeError, match="batched_cholesky_solve is not differentiable"):
        batched_cholesky_solve(L, b)
    with torch.no_grad():  # without a graph to build, the ops run
        batched_cholesky_solve(L, b)


def test_bad_inputs_raise_errors_naming_the_shapes():
    a, b = spd((2,), 4), rhs((2,), 4, 3, torch.float64)
    cases = [
        (lambda: batched_cholesky(torch.zeros(2, 4, 5)), ValueError, r"square matrices \[..., n, n\], got shape \(2, 4, 5\)"),
        (lambda: batched_cholesky(torch.zeros(4)), ValueError, r"got shape \(4,\)"),
        (lambda: batched_cholesky(a.half()), TypeError, "float32 or float64, got torch.float16"),
        (lambda: batched_cholesky(a.long()), TypeError, "float32 or float64, got torch.int64"),
        (lambda: batched_cholesky_solve(a[..., :3], b), ValueError, r"L must be a batch of square .* \(2, 4, 3\)"),
        (lambda: batched_cholesky_solve(a, b[:1]), ValueError, r"batch dimensions of L .* L \(2, 4, 4\) and B \(1, 4, 3\)"),
        (lambda: batched_cholesky_solve(a, b[0]), ValueError, r"got L \(2, 4, 4\) and B \(4, 3\)"),
        (lambda: batched_cholesky_solve(a, b[:, :3]), ValueError, r"n = 4 but B \(2, 3, 3\) has 3 rows"),
        (lambda: batched_cholesky_solve(a, b.float()), TypeError, "share a dtype, got torch.float64 and torch.float32"),
        (lambda: batched_cholesky_solve(a.bfloat16(), b.bfloat16()), TypeError, "got torch.bfloat16"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()


def test_the_raw_ops_check_their_inputs_too():
    a, b = spd((2,), 4), rhs((2,), 4, 3, torch.float64)
    ops = torch.ops.attn_ext
    with pytest.raises(RuntimeError, match=r"square matrices \[..., n, n\], got shape \[2, 4, 3\]"):
        ops.batched_cholesky(a[..., :3])
    with pytest.raises(RuntimeError, match="supports float32 and float64 only, got A of dtype Half"):
        ops.batched_cholesky(a.half())
    with pytest.raises(RuntimeError, match=r"no broadcasting\), got B of shape \[1, 4, 3\]"):
        ops.batched_cholesky_solve(a, b[:1])
    with pytest.raises(RuntimeError, match="must share a dtype"):
        ops.batched_cholesky_solve(a, b.float())
