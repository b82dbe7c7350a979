"""Intention and σIntention on singular systems and non-finite inputs (docs/intention.md), every form and backend.

* α = 0 needs KᵀK invertible: fewer valid keys than D, or exactly rank-deficient keys, raise a RuntimeError
  naming the op, the (batch, head), the requirement and the remedy, on every form (the dual form must not
  return the minimum-norm interpolant) and backend; with D or more keys of full rank α = 0 is exact.
* A NaN/inf in a valid key or value makes its whole (batch, head) NaN, one in a query row that row; nothing
  else changes (compared with an independent fp64 solve); padding keys are never read; the backward gives
  NaN gradients for the NaN head and the clean gradients everywhere else.

Triton runs in fp32 (it has no fp64), the other backends in fp64.
"""
import math

import pytest
import torch

import attn_ext as ae

from _helpers import require_backend

F64 = torch.float64
BACKENDS = ["cpp", "triton", "reference"]
# (form, N) with D = 8: "auto" takes the primal form (the dual pays off only for large heads); "dual" with N >= D and "primal" with
# N < D (α > 0) are forced.
FORMS = [("primal", 12), ("primal", 5), ("dual", 12), ("dual", 5), ("auto", 12), ("auto", 5)]
B, H, M, D, DV = 2, 2, 3, 8, 3
SINGULAR = (r"attn_ext\.{op}: KᵀK \+ αI is singular at \[batch, head\] = \[{b}, \d\]: .*alpha = 0 needs KᵀK "
            r"invertible, i\.e\. at least D valid keys \(N >= D\) of full rank D .*use alpha > 0")


def make(backend, N, seed=0, mask=True):
    """fp64 q, k, v, the padding mask (batch 0 pads key 1) and the backend's dtype."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, d, generator=g, dtype=F64) for n, d in ((M, D), (N, D), (N, DV)))
    key_padding_mask = None
    if mask:
        key_padding_mask = torch.zeros(B, N, dtype=torch.bool)
        key_padding_mask[0, 1] = True
    dtype = torch.float32 if backend == "triton" else F64
    require_backend(backend, q.to(dtype))
    return q, k, v, key_padding_mask, dtype


def close(backend):
    return dict(rtol=1e-4, atol=1e-4) if backend == "triton" else dict(rtol=1e-9, atol=1e-9)


def valid_rows(t, mask, b):
    return t[b] if mask is None else t[b][:, ~mask[b]]


def solve_reference(q, k, v, alpha, mask, sigma=False):
    """Per (b, h), an independent fp64 ``torch.linalg.solve`` over the valid keys (differentiable)."""
    alpha = torch.as_tensor(alpha, dtype=F64).expand(B, H)
    rows = []
    for b in range(B):
        kb, vb = valid_rows(k, mask, b), valid_rows(v, mask, b)
        heads = []
        for h in range(H):
            A = kb[h].T @ kb[h] + alpha[b, h] * torch.eye(D, dtype=F64)
            if sigma:
                q_tilde = torch.linalg.solve(A, q[b, h].T).T
                heads.append(torch.softmax(q_tilde @ kb[h].T, -1) @ vb[h])
            else:
                heads.append(q[b, h] @ torch.linalg.solve(A, kb[h].T @ vb[h]))
        rows.append(torch.stack(heads))
    return torch.stack(rows)


# --------------------------------------------------------------------------- α = 0

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["primal", "dual", "auto"])
@pytest.mark.parametrize("case", ["fewer_keys_than_d", "masked_to_fewer", "rank_deficient"])
def test_alpha_zero_singular_raises_on_every_form_and_backend(backend, form, case):
    N = 5 if case == "fewer_keys_than_d" else 12
    q, k, v, mask, dtype = make(backend, N, mask=case == "masked_to_fewer")
    bad_batch = r"\d"
    if case == "masked_to_fewer":
        mask[1, :7] = True  # batch 1 keeps 5 < D keys
        bad_batch = "1"
    if case == "rank_deficient":
        k[..., 6:] = 0  # N >= D keys spanning 6 of 8 dimensions: an exactly zero pivot
    with pytest.raises(RuntimeError, match=SINGULAR.format(op="intention", b=bad_batch)):
        ae.intention(q.to(dtype), k.to(dtype), v.to(dtype), alpha=0.0, key_padding_mask=mask, form=form,
                     backend=backend)


def test_alpha_zero_message_says_why():
    q, k, v, _, _ = make("cpp", 5, mask=False)
    with pytest.raises(RuntimeError, match=r"alpha = 0 with 5 valid keys for head dim D = 8 \(KᵀK has rank at most "
                                           r"5\)\. alpha = 0 needs"):
        ae.intention(q, k, v, alpha=0.0, backend="cpp")
    q, k, v, _, _ = make("cpp", 10, mask=False)
    k[..., 6:] = 0  # 10 keys spanning 6 dimensions: the pivot of column 6 is exactly 0
    with pytest.raises(RuntimeError, match=r"the Cholesky pivot of column 6 of 8 is not positive \(alpha = 0, 10 "
                                           r"valid keys\)"):
        ae.intention(q, k, v, alpha=0.0, backend="cpp")


@pytest.mark.parametrize("backend", BACKENDS)
def test_alpha_zero_in_one_head_only_names_that_head(backend):
    q, k, v, _, dtype = make(backend, 5, mask=False)
    alpha = torch.tensor([0.5, 0.0], dtype=dtype)  # per head: head 1 is singular in both batch entries
    with pytest.raises(RuntimeError, match=r"singular at \[batch, head\] = \[\d, 1\]"):
        ae.intention(q.to(dtype), k.to(dtype), v.to(dtype), alpha=alpha, form="primal", backend=backend)
    with pytest.raises(RuntimeError, match=r"singular at \[batch, head\] = \[\d, 1\]"):
        ae.intention(q.to(dtype), k.to(dtype), v.to(dtype), alpha=alpha, form="dual", backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["fewer_keys_than_d", "rank_deficient"])
def test_sigma_intention_alpha_zero_singular_raises(backend, case):
    q, k, v, _, dtype = make(backend, 5 if case == "fewer_keys_than_d" else 12, mask=False)
    if case == "rank_deficient":
        k[..., 6:] = 0
    with pytest.raises(RuntimeError, match=SINGULAR.format(op="sigma_intention", b=r"\d")):
        ae.sigma_intention(q.to(dtype), k.to(dtype), v.to(dtype), alpha=0.0, backend=backend)


def test_intention_from_state_alpha_zero_singular_raises():
    q, k, v, _, _ = make("reference", 5, mask=False)
    state = ae.intention_state(k, v)
    with pytest.raises(RuntimeError, match=SINGULAR.format(op="intention_from_state", b=r"\d")):
        ae.intention_from_state(q, state, alpha=0.0)
    k = torch.cat([k, k], 2)
    k[..., 4:] = 0  # 10 keys spanning 4 dimensions
    state = ae.intention_state(k, torch.cat([v, v], 2))
    with pytest.raises(RuntimeError, match="intention_from_state: .*Cholesky pivot of column 4 of 8"):
        ae.intention_from_state(q, state, alpha=0.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["primal", "dual", "auto"])
def test_alpha_zero_with_enough_keys_of_full_rank_is_exact(backend, form):
    q, k, v, mask, dtype = make(backend, 12, seed=1)
    out = ae.intention(q.to(dtype), k.to(dtype), v.to(dtype), alpha=0.0, key_padding_mask=mask, form=form,
                       backend=backend)
    torch.testing.assert_close(out.double(), solve_reference(q, k, v, 0.0, mask), **close(backend))
    sigma = ae.sigma_intention(q.to(dtype), k.to(dtype), v.to(dtype), alpha=0.0, key_padding_mask=mask,
                               backend=backend)
    torch.testing.assert_close(sigma.double(), solve_reference(q, k, v, 0.0, mask, sigma=True), **close(backend))


# --------------------------------------------------------------------------- non-finite inputs

POISON = {"key": (0, 1, 3, 2), "value": (0, 1, 3, 2), "query": (1, 0, 1, 2)}


def poisoned(which, value, q, k, v):
    q, k, v = q.clone(), k.clone(), v.clone()
    {"query": q, "key": k, "value": v}[which][POISON[which]] = value
    return q, k, v


def expected_nan(which, out_shape):
    """The rule: a key or value poisons its whole (batch, head), a query its row."""
    nan = torch.zeros(out_shape, dtype=torch.bool)
    b, h, row, _ = POISON[which]
    if which == "query":
        nan[b, h, row] = True
    else:
        nan[b, h] = True
    return nan


def assert_nan_exactly(out, expected_mask, clean, backend):
    assert torch.equal(torch.isnan(out), expected_mask), torch.isnan(out).flatten(2).any(-1)
    torch.testing.assert_close(out.double()[~expected_mask], clean[~expected_mask], **close(backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form,N", FORMS)
@pytest.mark.parametrize("which", ["key", "value", "query"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_input_gives_nan_exactly_where_the_rule_says(backend, form, N, which, value):
    q, k, v, mask, dtype = make(backend, N, seed=N)
    clean = solve_reference(q, k, v, 0.7, mask)
    qp, kp, vp = (t.to(dtype) for t in poisoned(which, value, q, k, v))
    out = ae.intention(qp, kp, vp, alpha=0.7, key_padding_mask=mask, form=form, backend=backend)
    assert_nan_exactly(out, expected_nan(which, out.shape), clean, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["key", "query"])
def test_non_finite_input_without_mask(backend, which):
    """Unmasked fp32/fp64 inputs take the kernels' in-place paths (no gathered copy of K or Q)."""
    q, k, v, _, dtype = make(backend, 12, mask=False)
    clean = solve_reference(q, k, v, 0.7, None)
    out = ae.intention(*(t.to(dtype) for t in poisoned(which, math.inf, q, k, v)), alpha=0.7, backend=backend)
    assert_nan_exactly(out, expected_nan(which, out.shape), clean, backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("which", ["key", "value", "query"])
def test_non_finite_input_low_precision_cpp(dtype, which):
    q, k, v, mask, _ = make("cpp", 12)
    out = ae.intention(*(t.to(dtype) for t in poisoned(which, math.inf, q, k, v)), alpha=0.7, key_padding_mask=mask,
                       backend="cpp")
    assert torch.equal(torch.isnan(out), expected_nan(which, out.shape))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form,N", FORMS)
def test_padding_keys_are_never_read(backend, form, N):
    q, k, v, mask, dtype = make(backend, N, seed=2)
    mask[1, 2] = True
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 1], v2[0, :, 1] = math.nan, math.inf  # batch 0's padding key
    k2[1, :, 2], v2[1, :, 2] = -math.inf, math.nan
    out = ae.intention(q.to(dtype), k2.to(dtype), v2.to(dtype), alpha=0.7, key_padding_mask=mask, form=form,
                       backend=backend)
    torch.testing.assert_close(out.double(), solve_reference(q, k, v, 0.7, mask), **close(backend))


def test_non_finite_statistics_of_a_state_give_nan_heads():
    q, k, v, _, _ = make("reference", 12, mask=False)
    kp = poisoned("key", math.nan, q, k, v)[1]
    out = ae.intention_from_state(q, ae.intention_state(kp, v), alpha=0.7)
    assert_nan_exactly(out, expected_nan("key", out.shape), solve_reference(q, k, v, 0.7, None), "reference")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["key", "query", "value_row"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_sigma_intention_non_finite_inputs(backend, which, value):
    q, k, v, mask, dtype = make(backend, 12, seed=3)
    clean = solve_reference(q, k, v, 0.7, mask, sigma=True)
    if which == "value_row":
        if value != value:  # a whole NaN value row reaches every output of its head through the softmax
            v = v.clone()
            v[POISON["value"][:3]] = value
        else:
            pytest.skip("an inf value is the attention's matter (docs/cross_attention.md), not Intention's")
        qp, kp, vp = q, k, v
    else:
        qp, kp, vp = poisoned(which, value, q, k, v)
    out = ae.sigma_intention(qp.to(dtype), kp.to(dtype), vp.to(dtype), alpha=0.7, key_padding_mask=mask,
                             backend=backend)
    assert_nan_exactly(out, expected_nan("value" if which == "value_row" else which, out.shape), clean, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigma_intention_padding_key_is_never_read(backend):
    q, k, v, mask, dtype = make(backend, 12, seed=4)
    k2 = k.clone()
    k2[0, :, 1] = math.nan
    out = ae.sigma_intention(q.to(dtype), k2.to(dtype), v.to(dtype), alpha=0.7, key_padding_mask=mask,
                             backend=backend)
    torch.testing.assert_close(out.double(), solve_reference(q, k, v, 0.7, mask, sigma=True), **close(backend))


# --------------------------------------------------------------------------- backward

def grads(fn, q, k, v, alpha):
    leaves = [t.clone().requires_grad_() for t in (q, k, v, alpha)]
    out = fn(*leaves)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    (out * weights).sum().backward()  # NaN loss, finite upstream gradient everywhere
    return [t.grad.double() for t in leaves]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op,form,N", [("intention", "primal", 12), ("intention", "dual", 5),
                                       ("intention", "auto", 12), ("sigma_intention", None, 12)])
def test_backward_gives_nan_for_the_nan_head_and_clean_gradients_elsewhere(backend, op, form, N):
    q, k, v, mask, dtype = make(backend, N, seed=5)
    alpha = torch.full((B, H), 0.7, dtype=F64)  # one α per (batch, head): a NaN head stays in its entry
    kwargs = dict(key_padding_mask=mask, backend=backend, **({} if form is None else {"form": form}))

    def run(q, k, v, a):
        return getattr(ae, op)(q, k, v, alpha=a, **kwargs)

    def ref(q, k, v, a):
        return solve_reference(q, k, v, a, mask, sigma=op == "sigma_intention")

    _, kp, _ = poisoned("key", math.nan, q, k, v)
    got = grads(run, *(t.to(dtype) for t in (q, kp, v, alpha)))
    clean = grads(ref, q, k, v, alpha)
    bad = torch.zeros(B, H, dtype=torch.bool)
    bad[0, 1] = True
    for name, g, c in zip("qkva", got, clean):
        torch.testing.assert_close(g[~bad], c[~bad], **close(backend), msg=f"d{name} of the clean heads")
        if name in "kv":
            # σIntention's values and padding keys enter only the softmax attention: their gradients
            # in a NaN row are the attention's matter (docs/cross_attention.md), not Intention's.
            if op == "intention" or name == "k":
                assert torch.isnan(g[0, 1][~mask[0]]).all(), f"d{name} of the valid keys"
            if op == "intention":
                assert not g[0, 1][mask[0]].any(), f"d{name} of the padding key"
        else:
            assert torch.isnan(g[0, 1]).all(), f"d{name}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_non_finite_query_rows_with_zero_scale(backend, dtype):
    """scale = 0 multiplies every product by 0, but a non-finite query row is still a NaN row."""
    q, k, v, mask, backend_dtype = make(backend, 12, seed=6)
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("Triton has no fp64")
    qp = poisoned("query", -math.inf, q, k, v)[0]
    out = ae.intention(qp.to(dtype), k.to(dtype), v.to(dtype), alpha=0.7, key_padding_mask=mask, scale=0.0,
                       backend=backend)
    expected = expected_nan("query", out.shape)
    assert torch.equal(torch.isnan(out), expected) and not out[~expected].any()


# --------------------------------------------------------------------------- no keys at all
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["primal", "dual", "auto"])
@pytest.mark.parametrize("dv", [1, DV, D])      # Dv < D once: C = I would have written past [G | C]
def test_zero_keys_give_zero_outputs_and_gradients(backend, form, dv):
    # An empty v has a null data pointer, like "no values" (σIntention's C = I) had in the CPU and CUDA
    # kernels, which then returned scale·Q (KᵀK + αI)⁻¹ = Q/α instead of 0.
    q, _, _, _, dtype = make(backend, N=4, mask=False)
    q = q.to(dtype).requires_grad_()
    k = torch.empty(B, H, 0, D, dtype=dtype, requires_grad=True)
    v = torch.empty(B, H, 0, dv, dtype=dtype, requires_grad=True)
    alpha = torch.full((H,), 0.5, dtype=dtype, requires_grad=True)
    out = ae.intention(q, k, v, alpha=alpha, backend=backend, form=form)
    assert out.shape == (B, H, M, dv) and torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert torch.equal(alpha.grad, torch.zeros_like(alpha))
    # σIntention with no keys answers 0, as a fully padded row of attention (and of σIntention) does.
    sigma = ae.sigma_intention(q.detach(), k.detach(), v.detach(), alpha=0.5, backend=backend)
    assert sigma.shape == (B, H, M, dv) and torch.equal(sigma, torch.zeros_like(sigma))
    with pytest.raises(RuntimeError, match=SINGULAR.format(op="intention", b=0)):
        ae.intention(q.detach(), k.detach(), v.detach(), alpha=0.0, backend=backend, form=form)
