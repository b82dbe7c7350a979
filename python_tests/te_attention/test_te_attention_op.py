"""``ae.te_attention`` (the fused op) on its backends against the dense formula of ``attn_ext.ops.te_attention.naive``
in fp64: outputs, log-sum-exps and the gradients of all nine tensors over odd shapes (sizes 0 and 1, odd head dims,
hidden widths off the kernels' block of four, several query and key tiles), every activation, padding (a batch entry
all padded, NaN behind padding), strided inputs and chunk sizes; non-finite inputs reach their rows only."""
from __future__ import annotations

import pytest
import torch

import attn_ext as ae
from python_tests._helpers import require_backend
from python_tests.te_attention._te_problems import dense, make_mask, make_problem

BACKENDS = ("cpp", "reference")
ACTIVATIONS = ("relu", "gelu", "silu", "tanh")
F64 = torch.float64

SHAPES = [  # (B, H, M, N, D, Dv, dx, hidden)
    (2, 2, 5, 9, 4, 3, 2, 6),
    (1, 3, 37, 150, 5, 7, 1, 9),      # several query tiles (16) and key tiles (64); hidden 9: a partial block
    (2, 1, 1, 1, 3, 2, 3, 4),
    (1, 2, 0, 7, 4, 4, 2, 5),         # no query
    (2, 2, 4, 0, 4, 4, 2, 5),         # no key: out 0, lse -inf
    (1, 4, 17, 65, 8, 8, 2, 64),      # TE-TNP's sizes, one key past a tile
    (1, 2, 3, 5, 0, 3, 1, 3),         # D = 0: the logits see only the differences
    (1, 2, 3, 5, 2, 0, 1, 3),         # Dv = 0
    (1, 2, 3, 5, 2, 2, 1, 1),
]


def _call(backend, problem, mask=None, activation="relu", **kwargs):
    return ae.te_attention(*problem, key_padding_mask=mask, activation=activation, return_lse=True, backend=backend,
                           **kwargs)


def _grads(out, lse, inputs, seed=5):
    g = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(out.shape, generator=g, dtype=out.dtype)
    grad_lse = torch.randn(lse.shape, generator=g, dtype=lse.dtype)
    lse_finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    objective = (out * grad_out).sum() + (lse_finite * grad_lse).sum()
    return torch.autograd.grad(objective, inputs, allow_unused=True, materialize_grads=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask_kind", ["none", "padding", "one_entry_all_padded"])
def test_forward_and_all_gradients_equal_the_dense_formula(backend, shape, mask_kind):
    B, H, M, N, D, Dv, dx, hidden = shape
    problem = [t.requires_grad_() for t in make_problem(*shape)]
    require_backend(backend, problem[0])
    mask = make_mask(B, N, mask_kind)
    out, lse = _call(backend, problem, mask)
    ref_out, ref_lse = dense(problem, mask)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-12)
    for name, ours, theirs in zip("q k v xq xk w1 b1 w2 b2".split(), _grads(out, lse, problem),
                                  _grads(ref_out, ref_lse, problem)):
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-11, msg=lambda m, name=name: f"grad {name}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("chunk_size", [0, 1, 7])
def test_activations_and_chunk_sizes(backend, activation, chunk_size):
    problem = [t.requires_grad_() for t in make_problem(1, 2, 19, 23, 3, 2, 2, 7, seed=3)]
    require_backend(backend, problem[0])
    mask = make_mask(1, 23, "padding")
    out, lse = _call(backend, problem, mask, activation, chunk_size=chunk_size)
    ref_out, ref_lse = dense(problem, mask, activation)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-12)
    for ours, theirs in zip(_grads(out, lse, problem), _grads(ref_out, ref_lse, problem)):
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs_and_a_scale(backend):
    B, H, M, N, D, dx = 2, 3, 6, 11, 4, 2
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, M, H, D, generator=g, dtype=F64).transpose(1, 2)          # strided views, as a module's
    k = torch.randn(B, N, H, 2 * D, generator=g, dtype=F64).transpose(1, 2)[..., ::2]
    v = torch.randn(B, N, H, D, generator=g, dtype=F64).transpose(1, 2)
    xq = torch.randn(B, dx, M, generator=g, dtype=F64).transpose(1, 2)
    xk = torch.randn(B, N, dx, generator=g, dtype=F64)
    w1 = torch.randn(H + dx, 5, generator=g, dtype=F64).t()
    rest = make_problem(B, H, M, N, D, D, dx, 5)[6:]
    problem = [q, k, v, xq, xk, w1, *rest]
    require_backend(backend, q)
    out, lse = _call(backend, problem, scale=0.3)
    ref_out, ref_lse = dense([t.contiguous() for t in problem], scale=0.3)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_behind_padding_reaches_nothing(backend):
    problem = make_problem(2, 2, 5, 9)
    require_backend(backend, problem[0])
    mask = make_mask(2, 9, "padding")
    for b in range(2):  # NaN in every padded key's k, v and xk rows
        problem[1][b, :, mask[b]] = float("nan")
        problem[2][b, :, mask[b]] = float("inf")
        problem[4][b, mask[b]] = float("nan")
    problem = [t.requires_grad_() for t in problem]
    out, lse = _call(backend, problem, mask)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert all(torch.isfinite(g).all() for g in _grads(out, lse, problem))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["q", "k", "v", "xq", "xk"])
def test_a_non_finite_input_reaches_its_rows_and_never_vanishes(backend, where):
    """NaN in one query's (or key's) row: that query's (or every query's) output is NaN, as the dense formula's;
    never a finite value in its place."""
    problem = make_problem(2, 2, 5, 9)
    require_backend(backend, problem[0])
    index = {"q": (1, 0, 2, 0), "k": (1, 1, 3, 0), "v": (1, 1, 3, 0), "xq": (1, 2, 0), "xk": (1, 3, 0)}[where]
    problem["q k v xq xk".split().index(where)][index] = float("nan")
    out, _ = _call(backend, problem)
    ref, _ = dense(problem)
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), f"NaN pattern of {where}"
    assert torch.isnan(out[1]).any() and torch.isfinite(out[0]).all()


def test_translation_equivariance_is_exact_where_the_differences_are():
    """Inputs on a grid of 1/8 and a shift of 1024: every difference is exact, so the shifted call gives the
    same bits; a random shift of size 1e3 changes only the rounding of the differences (fp32)."""
    problem = make_problem(2, 4, 30, 70, 8, 8, 2, 16, dtype=torch.float32)
    problem[3] = torch.round(problem[3] * 8) / 8
    problem[4] = torch.round(problem[4] * 8) / 8
    out = ae.te_attention(*problem)
    shifted = [*problem[:3], problem[3] + 1024.0, problem[4] + 1024.0, *problem[5:]]
    assert torch.equal(ae.te_attention(*shifted), out)
    shift = torch.tensor([734.21, -1201.7])
    moved = [*problem[:3], problem[3] + shift, problem[4] + shift, *problem[5:]]
    torch.testing.assert_close(ae.te_attention(*moved), out, rtol=0, atol=1e-3)


def test_the_reference_backend_streams_the_keys(monkeypatch):
    """The reference op holds one chunk's hidden layer at a time (as the kernels, one tile's)."""
    from attn_ext.ops.te_attention import naive

    problem = make_problem(1, 2, 20, 300, 4, 4, 2, 8)
    seen, real = [], naive.ACTIVATIONS["relu"]
    monkeypatch.setitem(naive.ACTIVATIONS, "relu", lambda t: seen.append(t.numel()) or real(t))
    ae.te_attention(*problem, backend="reference", chunk_size=50)
    assert seen and max(seen) == 20 * 50 * 8
