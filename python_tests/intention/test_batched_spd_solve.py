"""attn_ext.batched_spd_solve (factor and solve fused, differentiable) against torch.linalg (docs/spec.md §4).

Accuracy follows the rule of test_batched_cholesky.py: within twice the error of torch's own
same-precision ``cholesky_solve(B, cholesky(A))`` against fp64, plus a floor of a few ulps.
"""
import pytest
import torch

import attn_ext as ae
from _matrices import assert_as_accurate_as_torch, ill_conditioned, indefinite_at, rhs, spd

NS = (1, 2, 7, 40, 59, 64, 96, 128, 200)
RS = (1, 3, 64)
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("r", RS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
def test_matches_torch(dtype, r, n):
    a64, b64 = spd((3,), n, seed=n), rhs((3,), n, r, torch.float64, seed=r)
    a, b = a64.to(dtype), b64.to(dtype)
    x = ae.batched_spd_solve(a, b)
    assert x.shape == b.shape and x.dtype == dtype and x.is_contiguous()
    truth = torch.cholesky_solve(b64, torch.linalg.cholesky(a64))
    theirs = torch.cholesky_solve(b, torch.linalg.cholesky(a))
    assert_as_accurate_as_torch(x, theirs, truth, "X", floor_ulps=8 if dtype == torch.float32 else 8 * n)


@pytest.mark.parametrize("isa", ("baseline", "avx2", None))
def test_every_instruction_set(monkeypatch, isa):
    if isa is not None:
        monkeypatch.setenv("ATTN_EXT_CPU_ISA", isa)
    a, b = spd((4,), 59), rhs((4,), 59, 64, torch.float64)
    x = ae.batched_spd_solve(a.float(), b.float())
    assert torch.allclose(x.double(), torch.linalg.solve(a, b), rtol=1e-4, atol=1e-5)


def test_ill_conditioned_as_accurate_as_torch():
    a64 = ill_conditioned((8,), 64, 1e5, torch.float64)
    b64 = rhs((8,), 64, 5, torch.float64)
    truth = torch.linalg.solve(a64, b64)
    x = ae.batched_spd_solve(a64.float(), b64.float())
    theirs = torch.cholesky_solve(b64.float(), torch.linalg.cholesky(a64.float()))
    assert_as_accurate_as_torch(x, theirs, truth, "X", floor_ulps=8)


def test_reads_only_the_lower_triangle_and_any_strides():
    a, b = spd((6,), 40), rhs((6,), 40, 7, torch.float64)
    garbage = torch.triu(torch.full_like(a, 1e3), diagonal=1)
    expected = torch.linalg.solve(a, b)
    assert torch.allclose(ae.batched_spd_solve(a.tril() + garbage, b), expected)
    a_t = a.mT.contiguous().mT          # column-major matrices
    b_t = b.mT.contiguous().mT
    assert not a_t.is_contiguous() and not b_t.is_contiguous()
    assert torch.allclose(ae.batched_spd_solve(a_t, b_t), expected)
    a_big = torch.zeros(6, 50, 50, dtype=torch.float64)
    a_big[:, 3:43, 5:45] = a           # a view with row stride 50
    assert torch.allclose(ae.batched_spd_solve(a_big[:, 3:43, 5:45], b), expected)


def test_not_positive_definite_raises_or_gives_nan():
    good = spd((), 8)
    bad = indefinite_at(8, 3)
    a = torch.stack([good, bad, good])
    b = rhs((3,), 8, 2, torch.float64)
    with pytest.raises(ValueError, match=r"A\[1\].*not positive definite.*column 3"):
        ae.batched_spd_solve(a, b)
    x = ae.batched_spd_solve(a, b, check_errors=False)
    assert torch.isnan(x[1]).all()
    assert torch.allclose(x[0], torch.linalg.solve(good, b[0])) and torch.allclose(x[2], torch.linalg.solve(good, b[2]))


def test_empty_shapes():
    assert ae.batched_spd_solve(torch.empty(0, 4, 4), torch.empty(0, 4, 2)).shape == (0, 4, 2)
    assert ae.batched_spd_solve(torch.eye(3).expand(2, 3, 3), torch.empty(2, 3, 0)).shape == (2, 3, 0)


def test_bad_inputs():
    a, b = spd((2,), 4), rhs((2,), 4, 3, torch.float64)
    with pytest.raises(ValueError, match="square"):
        ae.batched_spd_solve(a[..., :3], b)
    with pytest.raises(ValueError, match="no broadcasting"):
        ae.batched_spd_solve(a, b[:1])
    with pytest.raises(ValueError, match="has 3 rows"):
        ae.batched_spd_solve(a, b[:, :3])
    with pytest.raises(TypeError, match="share a dtype"):
        ae.batched_spd_solve(a, b.float())
    with pytest.raises(TypeError, match="float32 or float64"):
        ae.batched_spd_solve(a.half(), b.half())


def test_gradcheck_and_gradgradcheck():
    a = spd((2,), 5).requires_grad_()
    b = rhs((2,), 5, 3, torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(ae.batched_spd_solve, (a, b))
    assert torch.autograd.gradgradcheck(ae.batched_spd_solve, (a, b))


def test_gradient_matches_torch_on_the_symmetrised_matrix():
    """Only the lower triangle is read, so autograd through ``solve(tril(A) + tril(A, -1)ᵀ, B)`` is the truth."""
    a = (spd((3,), 9) + torch.triu(torch.ones(9, 9, dtype=torch.float64), 1)).requires_grad_()
    b = rhs((3,), 9, 4, torch.float64).requires_grad_()
    g = rhs((3,), 9, 4, torch.float64, seed=7)
    ours = torch.autograd.grad(ae.batched_spd_solve(a, b), (a, b), g)
    symmetric = a.tril() + a.tril(-1).mT
    theirs = torch.autograd.grad(torch.linalg.solve(symmetric, b), (a, b), g)
    for x, y in zip(ours, theirs):
        assert torch.allclose(x, y, atol=1e-10)
    assert (ours[0].triu(1) == 0).all()


def test_opcheck():
    a = spd((2,), 6).requires_grad_()
    b = rhs((2,), 6, 3, torch.float64).requires_grad_()
    torch.library.opcheck(torch.ops.attn_ext.batched_spd_solve.default, (a, b), test_utils=OPCHECK_TESTS)
