"""Kernelised Intention (exact and Nyström) against direct float64 kernel algebra, limits, padding and errors."""
import pytest
import torch

import attn_ext as ae

from _intention_problems import BACKENDS, F64, problem as _problem  # noqa: F401


def problem(N=24, D=3, Dv=2, **kwargs):
    return _problem(N=N, D=D, Dv=Dv, **kwargs)


def rbf(x, y, ell):
    """``exp(−‖x − y‖²/(2ℓ²))`` from explicit differences (not the op's expansion)."""
    return torch.exp(-((x[..., :, None, :] - y[..., None, :, :]) ** 2).sum(-1) / (2 * ell ** 2))


def per_head_ell(ell, H):
    return torch.as_tensor(ell, dtype=F64).expand(H)


def kernel_ridge(q, k, v, alpha, ell, mask=None):
    """``k(Q, K)(k(K, K) + αI)⁻¹ V`` per (batch, head) over the valid keys."""
    B, H = q.shape[:2]
    out = torch.empty(B, H, q.shape[2], v.shape[-1], dtype=F64)
    ell = per_head_ell(ell, H)
    for b in range(B):
        keep = slice(None) if mask is None else ~mask[b]
        for h in range(H):
            kb, vb = k[b, h][keep], v[b, h][keep]
            system = rbf(kb, kb, ell[h]) + alpha * torch.eye(kb.shape[0], dtype=F64)
            out[b, h] = rbf(q[b, h], kb, ell[h]) @ torch.linalg.solve(system, vb)
    return out


def nystrom_by_eigh(q, k, v, alpha, ell, landmarks):
    """The paper's features ``φ(X) = k(X, L) k(L, L)^{-1/2}`` (symmetric root by ``eigh``), then ridge."""
    B, H = q.shape[:2]
    out = torch.empty(B, H, q.shape[2], v.shape[-1], dtype=F64)
    ell = per_head_ell(ell, H)
    for b in range(B):
        for h in range(H):
            L = k[b, h][landmarks[b]]
            evals, evecs = torch.linalg.eigh(rbf(L, L, ell[h]))
            root = evecs @ torch.diag(evals ** -0.5) @ evecs.mT
            fk, fq = rbf(k[b, h], L, ell[h]) @ root, rbf(q[b, h], L, ell[h]) @ root
            system = fk.mT @ fk + alpha * torch.eye(L.shape[0], dtype=F64)
            out[b, h] = fq @ torch.linalg.solve(system, fk.mT @ v[b, h])
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("masked", [False, True])
def test_exact_form_is_kernel_ridge_regression(backend, masked):
    q, k, v, mask = problem(masked=masked, seed=1)
    ell = torch.tensor([0.7, 1.0, 2.0], dtype=F64)
    out = ae.kernelised_intention(q, k, v, alpha=0.2, lengthscale=ell, key_padding_mask=mask, backend=backend)
    torch.testing.assert_close(out, kernel_ridge(q, k, v, 0.2, ell, mask), rtol=1e-8, atol=1e-8)


def test_exact_form_with_alpha_zero_interpolates():
    q, k, v, mask = problem(N=10, masked=True, seed=2)
    out = ae.kernelised_intention(q, k, v, alpha=0.0, lengthscale=0.8, key_padding_mask=mask)
    torch.testing.assert_close(out, kernel_ridge(q, k, v, 0.0, 0.8, mask), rtol=1e-7, atol=1e-7)
    at_keys = ae.kernelised_intention(k, k, v, alpha=0.0, lengthscale=0.8, key_padding_mask=mask)
    keep = ~mask[:, None, :, None].expand_as(v)
    torch.testing.assert_close(at_keys[keep], v[keep], rtol=1e-7, atol=1e-7)   # the values, reproduced


def test_nystrom_matches_the_papers_symmetric_root_features():
    q, k, v, _ = problem(N=30, seed=3)
    m = 7
    out = ae.kernelised_intention(q, k, v, alpha=0.1, lengthscale=1.3, num_landmarks=m)
    landmarks = [[(j * 30) // m for j in range(m)]] * 2          # evenly spaced over the keys
    torch.testing.assert_close(out, nystrom_by_eigh(q, k, v, 0.1, 1.3, landmarks), rtol=1e-8, atol=1e-8)
    assert not torch.allclose(out, kernel_ridge(q, k, v, 0.1, 1.3), rtol=1e-3, atol=1e-3)   # an approximation


def test_nystrom_with_padding_uses_evenly_spaced_valid_keys():
    q, k, v, _ = problem(N=20, seed=4)
    mask = torch.zeros(2, 20, dtype=torch.bool)
    mask[0, ::3] = True
    mask[1, 10:] = True
    out = ae.kernelised_intention(q, k, v, alpha=0.3, lengthscale=1.1, num_landmarks=5, key_padding_mask=mask)
    for b in range(2):
        keys = (~mask[b]).nonzero().flatten()
        n = keys.numel()
        landmarks = [keys[(j * n) // 5].item() for j in range(5)]
        keep = ~mask[b]
        sub = nystrom_by_eigh(q[b:b + 1], k[b:b + 1][:, :, keep], v[b:b + 1][:, :, keep], 0.3, 1.1,
                              [[keys.tolist().index(i) for i in landmarks]])
        torch.testing.assert_close(out[b:b + 1], sub, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("masked", [False, True])
def test_nystrom_with_every_key_as_landmark_is_exact(masked):
    q, k, v, mask = problem(N=16, masked=masked, seed=5)
    exact = ae.kernelised_intention(q, k, v, alpha=0.05, lengthscale=0.9, key_padding_mask=mask)
    torch.testing.assert_close(exact, kernel_ridge(q, k, v, 0.05, 0.9, mask), rtol=1e-8, atol=1e-8)
    for generator in (None, torch.Generator().manual_seed(0)):
        full = ae.kernelised_intention(q, k, v, alpha=0.05, lengthscale=0.9, num_landmarks=16,
                                       generator=generator, key_padding_mask=mask)
        torch.testing.assert_close(full, exact, rtol=1e-8, atol=1e-8)


def test_fewer_valid_keys_than_landmarks_uses_them_all_even_with_alpha_zero():
    q, k, v, _ = problem(N=12, seed=6)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[1, 4:] = True                                              # 4 valid keys, 6 landmarks asked
    out = ae.kernelised_intention(q, k, v, alpha=0.0, lengthscale=1.0, num_landmarks=6, key_padding_mask=mask)
    torch.testing.assert_close(out[1:], kernel_ridge(q[1:], k[1:, :, :4], v[1:, :, :4], 0.0, 1.0), rtol=1e-7,
                               atol=1e-7)


def test_random_landmarks_are_reproducible_and_distinct_from_the_even_choice():
    q, k, v, _ = problem(N=40, seed=7)
    draw = [ae.kernelised_intention(q, k, v, num_landmarks=8, generator=torch.Generator().manual_seed(s))
            for s in (1, 1, 2)]
    assert torch.equal(draw[0], draw[1])
    assert not torch.allclose(draw[0], draw[2])
    assert not torch.allclose(draw[0], ae.kernelised_intention(q, k, v, num_landmarks=8))


def test_linear_kernel_with_spanning_landmarks_is_plain_intention():
    q, k, v, _ = problem(N=20, D=4, seed=8)
    out = ae.kernelised_intention(q, k, v, alpha=0.4, kernel="linear", lengthscale=2.0, num_landmarks=4)
    torch.testing.assert_close(out, ae.intention(q / 2, k / 2, v, alpha=0.4), rtol=1e-9, atol=1e-9)


def test_large_alpha_limits():
    q, k, v, _ = problem(N=12, seed=9)
    a = 1e9
    out = ae.kernelised_intention(q, k, v, alpha=a, lengthscale=1.2)
    assert float(out.abs().max()) < 1e-7
    torch.testing.assert_close(a * out, rbf(q, k, 1.2) @ v, rtol=1e-6, atol=1e-6)   # kernel "linear attention"
    ny = ae.kernelised_intention(q, k, v, alpha=a, lengthscale=1.2, num_landmarks=5)
    L = k[:, :, [(j * 12) // 5 for j in range(5)]]
    approx = rbf(q, L, 1.2) @ torch.linalg.solve(rbf(L, L, 1.2), rbf(L, k, 1.2)) @ v
    torch.testing.assert_close(a * ny, approx, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_landmarks", [None, 6])
def test_padding_keys_are_never_read(num_landmarks):
    q, k, v, mask = problem(N=15, masked=True, seed=10)
    out = ae.kernelised_intention(q, k, v, key_padding_mask=mask, num_landmarks=num_landmarks)
    k2 = k.masked_fill(mask[:, None, :, None], float("nan"))
    v2 = v.masked_fill(mask[:, None, :, None], float("inf"))
    torch.testing.assert_close(ae.kernelised_intention(q, k2, v2, key_padding_mask=mask, num_landmarks=num_landmarks),
                               out, rtol=0, atol=0)
    empty = torch.ones(2, 15, dtype=torch.bool)
    assert torch.equal(ae.kernelised_intention(q, k2, v2, key_padding_mask=empty), torch.zeros(2, 3, 5, 2, dtype=F64))


def test_non_finite_inputs_give_nan_heads_and_rows_without_error():
    q, k, v, _ = problem(N=15, seed=11)
    k[1, 2, 3, 0] = float("nan")        # a landmark in both forms (m = 4 picks keys 0, 3, 7, 11)
    k[1, 1, 5, 0] = float("nan")        # a landmark of the exact form only: enters m = 4 through φ(K)ᵀφ(K)
    v[0, 1, 5, 1] = float("inf")
    q[0, 0, 2, 1] = float("nan")
    for num_landmarks in (None, 4):
        out = ae.kernelised_intention(q, k, v, num_landmarks=num_landmarks)
        for b, h in ((1, 2), (1, 1), (0, 1)):
            assert out[b, h].isnan().all()
        assert out[0, 0, 2].isnan().all()
        assert out.isnan().sum() == 3 * out[1, 2].numel() + out.shape[-1]


def test_gradcheck():
    q, k, v, mask = problem(B=1, H=2, M=3, N=6, D=2, Dv=2, masked=True, seed=12)
    ell = torch.tensor([0.8, 1.5], dtype=F64, requires_grad=True)
    alpha = torch.tensor([0.3, 0.6], dtype=F64, requires_grad=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    for num_landmarks in (None, 4):     # the direct kernel-ridge path and the Nyström feature path
        fn = lambda q, k, v, ell, alpha: ae.kernelised_intention(q, k, v, alpha=alpha, lengthscale=ell,
                                                                 num_landmarks=num_landmarks, key_padding_mask=mask)
        assert torch.autograd.gradcheck(fn, (*leaves, ell, alpha), check_forward_ad=True)
        assert torch.autograd.gradgradcheck(fn, (*leaves, ell, alpha))


def test_singular_landmark_kernel_raises_and_jitter_fixes_it():
    q, k, v, _ = problem(N=10, seed=13)
    k[:, :, 4] = k[:, :, 2]                                                 # a duplicated key
    for feature_path in (dict(num_landmarks=10), dict(backend="torch")):    # every key a landmark; a named kernel
        with pytest.raises(RuntimeError, match=r"attn_ext\.kernelised_intention: the landmark kernel matrix .* not "
                                               r"positive definite at \[batch, head\] = \[0, 0\].*Pass a jitter above"):
            ae.kernelised_intention(q, k, v, alpha=0.1, **feature_path)
    out = ae.kernelised_intention(q, k, v, alpha=0.1, jitter=1e-8)
    torch.testing.assert_close(out, kernel_ridge(q, k, v, 0.1, 1.0), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match=r"linear kernel's k\(L, L\) = LLᵀ has rank at most D"):
        ae.kernelised_intention(q, k, v, kernel="linear", num_landmarks=10)


def test_direct_exact_form_needs_no_jitter_for_positive_alpha():
    # A duplicated key: k(K, K) is singular, k(K, K) + αI is not; the direct path answers exactly.
    q, k, v, mask = problem(N=10, masked=True, seed=13)
    k[:, :, 4] = k[:, :, 2]
    out = ae.kernelised_intention(q, k, v, alpha=0.1, key_padding_mask=mask)
    torch.testing.assert_close(out, kernel_ridge(q, k, v, 0.1, 1.0, mask), rtol=1e-10, atol=1e-10)
    # 300 keys in 2-D: numerically singular kernel matrix (the docs' example), no error without a jitter.
    q, k, v, _ = problem(N=300, D=2, seed=3)
    torch.testing.assert_close(ae.kernelised_intention(q, k, v, alpha=0.1), kernel_ridge(q, k, v, 0.1, 1.0),
                               rtol=1e-7, atol=1e-7)
    with pytest.raises(RuntimeError, match=r"attn_ext\.kernelised_intention: the kernel ridge system k\(K, K\) \+ αI "
                                           r"is not positive definite at \[batch, head\] = \[0, 0\].*alpha > 0"):
        ae.kernelised_intention(q, k, v, alpha=0.0)
    # The linear kernel's exact form is ridge regression on the scaled inputs: plain Intention.
    q, k, v, _ = problem(N=20, D=4, seed=8)
    torch.testing.assert_close(ae.kernelised_intention(q, k, v, alpha=0.4, kernel="linear", lengthscale=2.0),
                               ae.intention(q / 2, k / 2, v, alpha=0.4), rtol=1e-9, atol=1e-9)


def test_direct_exact_form_under_torch_func():
    q, k, v, _ = problem(B=3, H=2, N=8, seed=4)
    alpha = torch.tensor([0.2, 0.5], dtype=F64)
    per_head = lambda q, k, v: torch.cat([kernel_ridge(q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], float(alpha[h]), 1.0)
                                          for h in range(2)], dim=1)
    per_batch = torch.func.vmap(lambda q, k, v: ae.kernelised_intention(q[None], k[None], v[None], alpha=alpha)[0])
    torch.testing.assert_close(per_batch(q, k, v), per_head(q, k, v), rtol=1e-10, atol=1e-10)
    grad_q = torch.func.grad(lambda q: ae.kernelised_intention(q, k, v, alpha=alpha).sum())(q)
    q_leaf = q.clone().requires_grad_()
    per_head(q_leaf, k, v).sum().backward()
    torch.testing.assert_close(grad_q, q_leaf.grad, rtol=1e-9, atol=1e-10)
    k2 = k.clone()
    k2[0, 0, 5] = k2[0, 0, 1]
    with pytest.raises(RuntimeError, match=r"kernel ridge system .* \[batch, head\] = \[0, 0\]"):
        torch.func.vmap(lambda k: ae.kernelised_intention(q[:1], k[None], v[:1], alpha=0.0)[0])(k2)


def test_bad_arguments_name_the_op():
    q, k, v, _ = problem(N=10, seed=14)
    cases = [
        (dict(lengthscale=0.0), ValueError, "lengthscale must be positive and finite"),
        (dict(lengthscale=torch.tensor([1.0, -1.0, 1.0], dtype=F64)), ValueError, "lengthscale must be positive"),
        (dict(lengthscale=torch.ones(4, dtype=F64)), ValueError, r"lengthscale must be a float or a tensor broadcast"),
        (dict(kernel="matern"), ValueError, "unknown kernel 'matern'"),
        (dict(num_landmarks=0), ValueError, r"num_landmarks must be None \(exact\) or an int in \[1, N = 10\]"),
        (dict(num_landmarks=11), ValueError, "num_landmarks must be"),
        (dict(num_landmarks=2.0), ValueError, "num_landmarks must be"),
        (dict(generator=torch.Generator()), ValueError, "a generator draws Nyström landmarks; pass num_landmarks"),
        (dict(num_landmarks=3, generator=3), TypeError, "generator must be a torch.Generator"),
        (dict(jitter=-1e-3), ValueError, "jitter must be a finite float >= 0"),
        (dict(alpha=-1.0), ValueError, "alpha must be"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=r"attn_ext\.kernelised_intention: " + message):
            ae.kernelised_intention(q, k, v, **kwargs)
    with pytest.raises(ValueError, match=r"attn_ext\.kernelised_intention: .*same number of keys"):
        ae.kernelised_intention(q, k, v[:, :, :4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_precision_inputs(dtype):
    q, k, v, _ = problem(N=12, seed=15)
    out = ae.kernelised_intention(q.to(dtype), k.to(dtype), v.to(dtype), alpha=0.5, num_landmarks=6)
    assert out.dtype == dtype
    expected = ae.kernelised_intention(*(t.to(dtype).double() for t in (q, k, v)), alpha=0.5, num_landmarks=6)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
