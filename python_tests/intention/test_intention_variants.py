"""The map w(K, V), the pseudo-inverse form and the paper's output scale, against direct float64 linear algebra."""
import pytest
import torch

import attn_ext as ae

from _intention_problems import BACKENDS, F64, problem  # noqa: F401


def valid(x, mask, b):
    """The rows of batch entry b that are not padding, ``[H, n, d]``."""
    return x[b] if mask is None else x[b][:, ~mask[b]]


def ridge_map_by_formula(k, v, alpha, mask):
    """``(KᵀK + αI)⁻¹ KᵀV`` per batch entry over its valid keys, by ``torch.linalg.solve``."""
    out = []
    for b in range(k.shape[0]):
        kb, vb = valid(k, mask, b), valid(v, mask, b)
        a = torch.as_tensor(alpha, dtype=F64).expand(k.shape[0], k.shape[1])[b]
        system = kb.mT @ kb + a[:, None, None] * torch.eye(k.shape[-1], dtype=F64)
        out.append(torch.linalg.solve(system, kb.mT @ vb))
    return torch.stack(out)


# ---- the map w(K, V) ------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("masked", [False, True])
def test_map_is_the_ridge_solution_and_reproduces_intention(backend, masked):
    q, k, v, mask = problem(masked=masked, seed=1)
    alpha = torch.tensor([0.1, 1.0, 4.0], dtype=F64)
    w = ae.intention_map(k, v, alpha=alpha, key_padding_mask=mask, backend=backend)
    assert w.shape == (2, 3, 8, 4) and w.dtype == F64
    torch.testing.assert_close(w, ridge_map_by_formula(k, v, alpha, mask), rtol=1e-10, atol=1e-10)
    out = ae.intention(q, k, v, alpha=alpha, key_padding_mask=mask, scale=0.7, backend=backend)
    torch.testing.assert_close(0.7 * q @ w, out, rtol=1e-10, atol=1e-10)


def test_map_dual_form_for_few_keys():
    _, k, v, _ = problem(N=5, D=12, seed=2)
    expected = ridge_map_by_formula(k, v, 0.3, None)
    for form in ("primal", "dual", "auto"):
        torch.testing.assert_close(ae.intention_map(k, v, alpha=0.3, form=form), expected, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("pinv", [False, True])
def test_streamed_map_equals_one_shot(pinv):
    _, k, v, mask = problem(N=60, masked=True, seed=3)
    parts = [slice(0, 20), slice(20, 45), slice(45, 60)]
    states = [ae.intention_state(k[:, :, s], v[:, :, s], key_padding_mask=mask[:, s]) for s in parts]
    state = ae.update_intention_state(ae.merge_intention_states(states[0], states[1]), k[:, :, parts[2]],
                                      v[:, :, parts[2]], key_padding_mask=mask[:, parts[2]])
    one_shot = ae.intention_map(k, v, alpha=0.5, key_padding_mask=mask, pinv=pinv)
    torch.testing.assert_close(ae.intention_map_from_state(state, alpha=0.5, pinv=pinv), one_shot, rtol=1e-10,
                               atol=1e-10)
    removed = ae.remove_from_intention_state(state, k[:, :, :20], v[:, :, :20], key_padding_mask=mask[:, :20])
    rest = ae.intention_map(k[:, :, 20:], v[:, :, 20:], alpha=0.5, key_padding_mask=mask[:, 20:], pinv=pinv)
    torch.testing.assert_close(ae.intention_map_from_state(removed, alpha=0.5, pinv=pinv), rest, rtol=1e-9,
                               atol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_map_gradients_match_autograd_of_the_formula(backend):
    _, k, v, mask = problem(B=2, H=2, N=12, D=4, Dv=3, masked=True, seed=4)
    alpha = torch.tensor([0.3, 2.0], dtype=F64)
    leaves = [t.clone().requires_grad_() for t in (k, v, alpha)]
    weight = torch.randn(2, 2, 4, 3, dtype=F64, generator=torch.Generator().manual_seed(0))
    w = ae.intention_map(leaves[0], leaves[1], alpha=leaves[2], key_padding_mask=mask, backend=backend)
    (w * weight).sum().backward()
    direct = [t.clone().requires_grad_() for t in (k, v, alpha)]
    (ridge_map_by_formula(direct[0], direct[1], direct[2], mask) * weight).sum().backward()
    for got, want in zip(leaves, direct):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-9, atol=1e-10)


def test_map_large_alpha_limits():
    _, k, v, _ = problem(N=30, D=6, seed=5)
    a = 1e9
    w = ae.intention_map(k, v, alpha=a)
    assert float(w.abs().max()) < 1e-7                                  # the map itself tends to 0 ...
    torch.testing.assert_close(a * w, k.mT @ v, rtol=1e-6, atol=1e-6)   # ... as KᵀV / α
    wp = ae.intention_map(k, v, alpha=a, pinv=True)
    torch.testing.assert_close(a * wp, k.mT @ v, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_map_of_half_inputs_is_float32(dtype):
    _, k, v, _ = problem(N=50, seed=6)
    w = ae.intention_map(k.to(dtype), v.to(dtype), alpha=1.0)
    assert w.dtype == torch.float32
    expected = ridge_map_by_formula(k.to(dtype).double(), v.to(dtype).double(), 1.0, None)
    torch.testing.assert_close(w.double(), expected, rtol=1e-4, atol=1e-5)


def test_map_errors_name_the_op():
    _, k, v, _ = problem(N=5, D=8, seed=7)
    with pytest.raises(RuntimeError, match=r"attn_ext\.intention_map: KᵀK \+ αI is singular"):
        ae.intention_map(k, v, alpha=0.0)
    with pytest.raises(RuntimeError, match=r"attn_ext\.intention_map_from_state: KᵀK \+ αI is singular"):
        ae.intention_map_from_state(ae.intention_state(k, v), alpha=0.0)
    with pytest.raises(ValueError, match=r"attn_ext\.intention_map: .*same number of keys"):
        ae.intention_map(k, v[:, :, :3])
    with pytest.raises(ValueError, match=r"attn_ext\.intention_map: alpha must be"):
        ae.intention_map(k, v, alpha=-1.0)
    with pytest.raises(ValueError, match=r"attn_ext\.intention_map: atol / rtol .* pinv=True"):
        ae.intention_map(k, v, rtol=1e-3)
    with pytest.raises(TypeError, match=r"attn_ext\.intention_map_from_state: state must be an IntentionState"):
        ae.intention_map_from_state((k, v))


def test_map_non_finite_key_gives_a_nan_head_only():
    _, k, v, _ = problem(N=20, seed=8)
    k[1, 2, 3, 0] = float("nan")
    for pinv in (False, True):
        w = ae.intention_map(k, v, alpha=0.5, pinv=pinv)
        nan_heads = w.isnan().flatten(2).all(-1)
        assert nan_heads.tolist() == [[False, False, False], [False, False, True]]
        assert not w.flatten(2)[~nan_heads].isnan().any()


# ---- the pseudo-inverse --------------------------------------------------------------------------

def rank_deficient_keys(case, seed=0):
    g = torch.Generator().manual_seed(seed)
    if case == "few_keys":           # N < D: KᵀK has rank N
        k = torch.randn(2, 3, 5, 9, generator=g, dtype=F64)
    elif case == "duplicated_columns":
        k = torch.randn(2, 3, 40, 6, generator=g, dtype=F64)
        k[..., 4] = k[..., 1]        # two identical features
        k[..., 5] = -2.0 * k[..., 0]  # and one proportional to another
    else:                            # full rank
        k = torch.randn(2, 3, 40, 6, generator=g, dtype=F64)
    v = torch.randn(*k.shape[:3], 4, generator=g, dtype=F64)
    q = torch.randn(2, 3, 7, k.shape[-1], generator=g, dtype=F64)
    return q, k, v


@pytest.mark.parametrize("case", ["few_keys", "duplicated_columns"])
def test_pinv_equals_torch_pinv_on_rank_deficient_keys(case):
    q, k, v = rank_deficient_keys(case)
    out = ae.pinv_intention(q, k, v)
    # Two independent routes: the pseudo-inverse of K itself (by its SVD), and that of KᵀK.
    torch.testing.assert_close(out, q @ torch.linalg.pinv(k) @ v, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(out, q @ torch.linalg.pinv(k.mT @ k, hermitian=True) @ (k.mT @ v), rtol=1e-8,
                               atol=1e-8)
    with pytest.raises(RuntimeError, match="singular"):   # the regular solve refuses these systems
        ae.intention(q, k, v, alpha=0.0)


def test_pinv_map_is_the_minimum_norm_least_squares_solution():
    _, k, v = rank_deficient_keys("duplicated_columns", seed=1)
    w = ae.intention_map(k, v, alpha=0.0, pinv=True)
    # Least squares: the residual is orthogonal to the keys' column space ...
    torch.testing.assert_close(k.mT @ (k @ w - v), torch.zeros_like(w), rtol=0, atol=1e-9)
    # ... and minimum norm: no component in the keys' null space (e1 − e4 and 2e0 + e5 here).
    null = torch.zeros(2, 6, dtype=F64)
    null[0, 1], null[0, 4], null[1, 0], null[1, 5] = 1.0, -1.0, 2.0, 1.0
    torch.testing.assert_close(null @ w, torch.zeros(2, 3, 2, 4, dtype=F64), rtol=0, atol=1e-9)


def test_pinv_with_padding_makes_a_head_rank_deficient():
    q, k, v, _ = problem(B=2, N=12, D=6, seed=9)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[1, 4:] = True                                   # batch entry 1 keeps 4 keys in 6 dimensions
    out = ae.pinv_intention(q, k, v, key_padding_mask=mask)
    for b in range(2):
        kb, vb = valid(k, mask, b), valid(v, mask, b)
        torch.testing.assert_close(out[b], q[b] @ torch.linalg.pinv(kb) @ vb, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_pinv_equals_the_regular_solve_when_the_system_is_invertible(alpha):
    q, k, v = rank_deficient_keys("full_rank", seed=2)
    torch.testing.assert_close(ae.pinv_intention(q, k, v, alpha=alpha, scale=1.5),
                               ae.intention(q, k, v, alpha=alpha, scale=1.5), rtol=1e-10, atol=1e-10)


def test_pinv_tolerances_are_those_of_torch_pinv():
    q, k, v = rank_deficient_keys("full_rank", seed=3)
    k = k * torch.tensor([1.0, 1.0, 1.0, 1.0, 1e-3, 1e-4], dtype=F64)   # eigenvalues of KᵀK ~ 40, 4e-5, 4e-7
    gram, kv = k.mT @ k, k.mT @ v
    for atol, rtol in ((None, None), (1e-5, None), (None, 1e-7), (1e-9, 1e-3)):
        expected = q @ torch.linalg.pinv(gram, atol=atol, rtol=rtol, hermitian=True) @ kv
        torch.testing.assert_close(ae.pinv_intention(q, k, v, atol=atol, rtol=rtol), expected, rtol=1e-9, atol=1e-9)
    cut = ae.pinv_intention(q, k, v, atol=1e-3)          # drops the two small directions: a different answer
    assert not torch.allclose(cut, ae.pinv_intention(q, k, v), rtol=1e-3, atol=1e-3)


def test_pinv_streaming_and_map_agree_with_one_shot():
    q, k, v = rank_deficient_keys("few_keys", seed=4)
    state = ae.update_intention_state(ae.intention_state(k[:, :, :2], v[:, :, :2]), k[:, :, 2:], v[:, :, 2:])
    one_shot = ae.pinv_intention(q, k, v, scale=2.0)
    torch.testing.assert_close(ae.pinv_intention_from_state(q, state, scale=2.0), one_shot, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(2.0 * q @ ae.intention_map(k, v, alpha=0.0, pinv=True), one_shot, rtol=1e-10,
                               atol=1e-10)


def test_pinv_large_alpha_limit_is_linear_attention():
    q, k, v = rank_deficient_keys("few_keys", seed=5)
    a = 1e9
    torch.testing.assert_close(ae.pinv_intention(q * a, k, v, alpha=a), (q @ k.mT) @ v, rtol=1e-6, atol=1e-6)
    assert float(ae.pinv_intention(q, k, v, alpha=a).abs().max()) < 1e-7


def test_pinv_gradcheck_at_constant_rank():
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, n, d, generator=g, dtype=F64, requires_grad=True) for n, d in ((3, 5), (3, 5), (3, 2)))
    alpha = torch.tensor([0.0, 0.4], dtype=F64)                 # head 0: rank 3 of 5; head 1: regular
    assert torch.autograd.gradcheck(lambda q, k, v: ae.pinv_intention(q, k, v, alpha=alpha), (q, k, v))
    positive = torch.tensor([0.2, 0.4], dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: ae.pinv_intention(q, k, v, alpha=a), (positive,))


def test_pinv_non_finite_inputs_follow_intention_rules():
    q, k, v = rank_deficient_keys("few_keys", seed=7)
    v[0, 1, 2, 0] = float("inf")
    q[1, 0, 3, 2] = float("nan")
    out = ae.pinv_intention(q, k, v)
    assert out[0, 1].isnan().all()
    assert out[1, 0, 3].isnan().all()
    assert out.isnan().sum() == out[0, 1].numel() + out.shape[-1]


def test_pinv_errors_name_the_op():
    q, k, v = rank_deficient_keys("few_keys", seed=8)
    with pytest.raises(ValueError, match=r"attn_ext\.pinv_intention: atol must be a finite float >= 0"):
        ae.pinv_intention(q, k, v, atol=-1.0)
    with pytest.raises(ValueError, match=r"attn_ext\.pinv_intention: q .* same head dim"):
        ae.pinv_intention(q[..., :4], k, v)
    with pytest.raises(ValueError, match=r"attn_ext\.pinv_intention_from_state: q .* does not match the state"):
        ae.pinv_intention_from_state(q[..., :4], ae.intention_state(k, v))
    with pytest.raises(ValueError, match=r"attn_ext\.intention_map: form / backend"):
        ae.intention_map(k, v, pinv=True, backend="cpp")


# ---- the paper's output scale ---------------------------------------------------------------------

def test_variance_scale_values_and_errors():
    assert ae.intention_variance_scale(64) == 8.0
    assert ae.intention_variance_scale(9, convex=True) == 1.5
    for bad in (0, -3, 2.0, True, None):
        with pytest.raises(ValueError, match=r"attn_ext\.intention_variance_scale: head_dim"):
            ae.intention_variance_scale(bad)


def test_variance_scale_makes_the_intention_map_unit_variance():
    # Z = √D·Q Kᵀ(KKᵀ)⁻¹ for standard-normal Q, K (N < D): the paper's scaled map. Its entries have
    # variance D·E[(KKᵀ)⁻¹]_jj = D/(D − N − 1) (the inverse-Wishart mean), which tends to 1, while the
    # unscaled map's 1/(D − N − 1) vanishes. Here Z is pinv_intention with the values V = I_N.
    D, N = 256, 8
    g = torch.Generator().manual_seed(10)
    q = torch.randn(64, 4, 32, D, generator=g, dtype=F64)
    k = torch.randn(64, 4, N, D, generator=g, dtype=F64)
    eye = torch.eye(N, dtype=F64).expand(64, 4, N, N)
    z = ae.pinv_intention(q, k, eye, scale=ae.intention_variance_scale(D))
    torch.testing.assert_close(z, ae.intention_variance_scale(D) * q @ k.mT @ torch.linalg.inv(k @ k.mT))
    expected = D / (D - N - 1)
    assert abs(float(z.var()) / expected - 1) < 0.03, (float(z.var()), expected)
    unscaled = float(ae.pinv_intention(q, k, eye).var())
    assert abs(unscaled * (D - N - 1) - 1) < 0.03


def test_auto_form_takes_the_dual_only_for_large_heads():
    # The dual form is PyTorch code with a fixed cost of a few hundred µs; the fused primal kernel is
    # faster at D <= 128 for every N (measured), so "auto" must not pick the dual there.
    from attn_ext.ops.intention.ridge import _dual_is_cheaper

    assert not any(_dual_is_cheaper(n, d) for d in (8, 19, 64, 128) for n in range(1, d))
    assert _dual_is_cheaper(8, 256) and _dual_is_cheaper(8, 512) and _dual_is_cheaper(256, 512)
    assert not _dual_is_cheaper(128, 256) and not _dual_is_cheaper(600, 512)
