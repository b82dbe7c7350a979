"""Intention and σIntention (docs/spec.md §4) against independent fp64 computations."""
from fractions import Fraction

import numpy as np
import pytest
import torch

import attn_ext as ae
from attn_ext.ops.intention import naive as reference
from attn_ext.ops.intention.conditioning import PRIMAL_TRACE_PER_ALPHA

BACKENDS = ["reference", "cpp"]
F64 = torch.float64


def problem(B=2, H=3, M=5, N=40, D=8, Dv=4, masked=False, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, d, generator=g, dtype=F64) for n, d in ((M, D), (N, D), (N, Dv)))
    mask = None
    if masked:
        mask = torch.rand(B, N, generator=g) < 0.3
        mask[:, 0] = False
    return q.to(dtype), k.to(dtype), v.to(dtype), mask


def ridge_by_lstsq(q, k, v, alpha, mask):
    """The ridge prediction from the augmented least-squares system ``[K; √α I] W ≈ [V; 0]``."""
    B, H, _, D = k.shape
    if mask is not None:
        k, v = k[:, :, ~mask[0]] if B == 1 else k, v[:, :, ~mask[0]] if B == 1 else v
    eye = torch.eye(D, dtype=F64).expand(B, H, D, D) * alpha**0.5
    W = torch.linalg.lstsq(torch.cat([k, eye], 2), torch.cat([v, torch.zeros(B, H, D, v.shape[-1], dtype=F64)], 2))
    return q @ W.solution


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("D", [8, 40, 64, 128])
@pytest.mark.parametrize("N", [1, 7, 130, 4099])
def test_equals_ridge_regression_by_lstsq(backend, D, N):
    q, k, v, _ = problem(B=1, H=2, M=3, N=N, D=D, Dv=5, seed=D + N)
    out = ae.intention(q, k, v, alpha=0.3, backend=backend)
    torch.testing.assert_close(out, ridge_by_lstsq(q, k, v, 0.3, None), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_keys_are_left_out(backend):
    q, k, v, mask = problem(B=1, N=60, masked=True, seed=3)
    out = ae.intention(q, k, v, alpha=0.5, key_padding_mask=mask, backend=backend)
    torch.testing.assert_close(out, ridge_by_lstsq(q, k, v, 0.5, mask), rtol=1e-10, atol=1e-10)
    # Whatever padding keys hold does not matter.
    k2 = k.masked_fill(mask[:, None, :, None], 1e3)
    torch.testing.assert_close(ae.intention(q, k2, v, alpha=0.5, key_padding_mask=mask, backend=backend), out)


@pytest.mark.parametrize("N,masked", [(3, False), (20, True), (200, True)])
def test_primal_equals_dual(N, masked):
    q, k, v, mask = problem(N=N, D=16, masked=masked, seed=N)
    primal = ae.intention(q, k, v, alpha=0.2, key_padding_mask=mask, form="primal")
    dual = ae.intention(q, k, v, alpha=0.2, key_padding_mask=mask, form="dual")
    torch.testing.assert_close(primal, dual, rtol=1e-9, atol=1e-9)
    # "auto" takes the dual form exactly on the heads with fewer valid keys than D whose tr(KᵀK) exceeds
    # PRIMAL_TRACE_PER_ALPHA·α (docs/intention.md), the primal elsewhere (the cheaper one at D = 16).
    valid = N - (mask.sum(1, keepdim=True) if masked else 0)
    trace = k.masked_fill(mask[:, None, :, None], 0).square().sum((-1, -2)) if masked else k.square().sum((-1, -2))
    in_dual = (torch.as_tensor(valid) < 16) & (trace > PRIMAL_TRACE_PER_ALPHA * 0.2)
    assert (N == 200 and not in_dual.any()) or (N < 200 and in_dual.any() and not in_dual.all())  # a mixed batch
    expected = torch.where(in_dual[..., None, None], dual, primal)
    torch.testing.assert_close(ae.intention(q, k, v, alpha=0.2, key_padding_mask=mask), expected, rtol=1e-12,
                               atol=1e-12)
    if N == 200:
        assert torch.equal(ae.intention(q, k, v, alpha=0.2, key_padding_mask=mask), primal)


def test_large_alpha_limits():
    q, k, v, _ = problem(N=30, D=6, seed=5)
    a = 1e9  # the limits hold up to O(|KᵀK| / α)
    linear = (q @ k.transpose(-1, -2)) @ v
    torch.testing.assert_close(ae.intention(q * a, k, v, alpha=a), linear, rtol=1e-5, atol=1e-5)
    softmax = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
    torch.testing.assert_close(ae.sigma_intention(q * a, k, v, alpha=a), softmax, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_sigma_intention_is_attention_of_transformed_queries(masked):
    q, k, v, mask = problem(N=50, D=8, masked=masked, seed=7)
    alpha = torch.tensor([0.1, 1.0, 3.0], dtype=F64)
    out = ae.sigma_intention(q, k, v, alpha=alpha, key_padding_mask=mask, scale=0.5)
    A = reference.regularised(reference.statistics(k, v, mask)[0], alpha.expand(2, 3))
    q_tilde = 0.5 * q @ torch.linalg.inv(A)
    scores = q_tilde @ k.transpose(-1, -2)
    if mask is not None:
        scores = scores.masked_fill(mask[:, None, None], float("-inf"))
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ v, rtol=1e-10, atol=1e-10)


def test_per_head_alpha_and_its_gradient():
    q, k, v, mask = problem(B=2, H=2, M=3, N=9, D=3, Dv=2, masked=True, seed=9)
    alpha = torch.tensor([0.2, 1.5], dtype=F64, requires_grad=True)
    inputs = tuple(t.clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(
        lambda q, k, v, a: ae.intention(q, k, v, alpha=a, key_padding_mask=mask), (*inputs, alpha))
    assert torch.autograd.gradcheck(
        lambda q, k, v, a: ae.sigma_intention(q, k, v, alpha=a, key_padding_mask=mask), (*inputs, alpha))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_inputs(dtype):
    q, k, v, mask = problem(N=300, D=40, Dv=59, masked=True, seed=11)
    exact = ae.intention(q, k, v, alpha=1.0, key_padding_mask=mask)
    out = ae.intention(q.to(dtype), k.to(dtype), v.to(dtype), alpha=1.0, key_padding_mask=mask)
    assert out.dtype == dtype
    # fp32 compute, one rounding of the inputs and of the output: relative to the output's scale.
    tol = 8 * torch.finfo(dtype).eps * exact.abs().max().item() * (1 if dtype == torch.float32 else 4)
    assert (out.double() - exact).abs().max().item() <= tol


def test_streaming_merge_and_remove_equal_one_shot():
    q, k, v, mask = problem(N=90, D=6, masked=True, seed=13)
    full = ae.intention(q, k, v, alpha=0.4, key_padding_mask=mask)
    st = ae.intention_state(k[:, :, :30], v[:, :, :30], key_padding_mask=mask[:, :30])
    st = ae.update_intention_state(st, k[:, :, 30:60], v[:, :, 30:60], key_padding_mask=mask[:, 30:60])
    other = ae.intention_state(k[:, :, 60:], v[:, :, 60:], key_padding_mask=mask[:, 60:])
    merged = ae.merge_intention_states(st, other)
    torch.testing.assert_close(ae.intention_from_state(q, merged, alpha=0.4), full, rtol=1e-10, atol=1e-10)
    assert merged.count[:, 0].tolist() == (~mask).sum(1).tolist()
    removed = ae.remove_from_intention_state(merged, k[:, :, 60:], v[:, :, 60:], key_padding_mask=mask[:, 60:])
    torch.testing.assert_close(ae.intention_from_state(q, removed, alpha=0.4),
                               ae.intention(q, k[:, :, :60], v[:, :, :60], alpha=0.4, key_padding_mask=mask[:, :60]),
                               rtol=1e-9, atol=1e-9)


def test_bad_inputs_raise_clear_errors():
    q, k, v, _ = problem(N=3, D=8, seed=1)
    with pytest.raises(RuntimeError, match=r"attn_ext\.intention: .*singular.*use alpha > 0"):
        ae.intention(q, k, v, alpha=0.0, form="primal")
    with pytest.raises(ValueError, match="alpha must be a finite float >= 0"):
        ae.intention(q, k, v, alpha=-1.0)
    with pytest.raises(ValueError, match="alpha must be finite and >= 0"):
        ae.intention(q, k, v, alpha=torch.tensor([1.0, -1.0, 1.0], dtype=F64))
    with pytest.raises(ValueError, match=r"broadcastable to \[B, H\] = \[2, 3\]"):
        ae.intention(q, k, v, alpha=torch.ones(4, dtype=F64))
    with pytest.raises(ValueError, match="unknown form"):
        ae.intention(q, k, v, form="both")
    with pytest.raises(ValueError, match="same head dim D"):
        ae.intention(q[..., :4], k, v)
    with pytest.raises(ValueError, match="same number of keys N"):
        ae.intention(q, k, v[:, :, :2])
    st = ae.intention_state(k, v)
    with pytest.raises(ValueError, match="cannot remove"):
        ae.remove_from_intention_state(st, torch.cat([k, k], 2), torch.cat([v, v], 2))
    with pytest.raises(ValueError, match="does not match the state"):
        ae.intention_from_state(q[..., :4], st)


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _op_names(backend):
    return {"cpp": ("intention_fwd", "intention_bwd"),
            "triton": ("intention_fwd_triton", "intention_bwd_triton")}[backend]


def _skip_unless(backend):
    reason = ae.available_backends(torch.zeros(1))[backend]
    if reason is not None:
        pytest.skip(f"backend {backend} unavailable: {reason}")


@pytest.mark.parametrize("backend", ["cpp", "triton"])
@pytest.mark.parametrize("masked", [False, True])
def test_opcheck(backend, masked):
    _skip_unless(backend)
    dtype = torch.float32 if backend == "triton" else F64
    q, k, v, mask = problem(B=2, H=2, M=3, N=11, D=5, Dv=3, masked=masked, seed=2, dtype=dtype)
    alpha = torch.tensor([[0.5, 1.0], [2.0, 0.1]], dtype=dtype)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), mask, alpha.requires_grad_(), 0.7)
    fwd_name, bwd_name = _op_names(backend)
    torch.library.opcheck(getattr(torch.ops.attn_ext, fwd_name), args, test_utils=OPCHECK_TESTS)
    out, factor, weights = getattr(torch.ops.attn_ext, fwd_name)(*args)
    bwd_args = (torch.randn_like(out), *(t.detach() for t in args[:3]), mask, factor.detach(), weights.detach(), 0.7)
    torch.library.opcheck(getattr(torch.ops.attn_ext, bwd_name), bwd_args, test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("backend", ["cpp", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_backends_equal_reference_with_gradients(backend, dtype):
    _skip_unless(backend)
    q, k, v, mask = problem(B=2, H=2, M=6, N=70, D=40, Dv=59, masked=True, seed=4)
    alpha = torch.tensor([0.3, 2.0], dtype=F64)
    w = torch.randn(2, 2, 6, 59, generator=torch.Generator().manual_seed(0), dtype=F64)

    def run(name, dt):
        inputs = tuple(t.detach().to(dt).requires_grad_() for t in (q, k, v))
        a = alpha.clone().to(torch.float32 if dt != F64 else F64).requires_grad_()
        out = ae.intention(*inputs, alpha=a, key_padding_mask=mask, scale=0.8, backend=name)
        grads = torch.autograd.grad((out.to(F64) * w).sum(), (*inputs, a))
        return out, grads

    exact_out, exact_grads = run("reference", F64)
    base_out, base_grads = run("reference", dtype)
    out, grads = run(backend, dtype)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads[:3])
    floor = 1e-5 if dtype == torch.float32 else 1e-2
    for name, e, o, r in zip(("out", "dq", "dk", "dv", "dalpha"), (exact_out, *exact_grads), (out, *grads),
                             (base_out, *base_grads)):
        scale = e.abs().max().item() + 1e-12
        err, ref_err = (o.double() - e).abs().max().item(), (r.double() - e).abs().max().item()
        assert err <= 3 * ref_err + floor * scale, f"{name}: {err} vs reference {dtype} error {ref_err}"


def test_transformed_queries_op_without_values():
    _skip_unless("cpp")
    q, k, _, mask = problem(B=2, H=2, M=3, N=11, D=5, masked=True, seed=6)
    alpha = torch.tensor([[0.5, 1.0], [2.0, 0.1]], dtype=F64)
    args = (q.requires_grad_(), k.requires_grad_(), None, mask, alpha.requires_grad_(), 0.7)
    torch.library.opcheck(torch.ops.attn_ext.intention_fwd, args, test_utils=OPCHECK_TESTS)
    q_tilde = torch.ops.attn_ext.intention_fwd(*args)[0]
    expected = reference.transformed_queries(q, k, alpha, mask, 0.7)
    torch.testing.assert_close(q_tilde, expected, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda q, k, a: torch.ops.attn_ext.intention_fwd(q, k, None, mask, a, 0.7)[0],
                                    (q, k, alpha))


@pytest.mark.parametrize("masked", [False, True])
def test_sigma_intention_cpp_equals_reference_float32(masked):
    _skip_unless("cpp")
    q, k, v, mask = problem(B=2, H=2, M=7, N=90, D=16, Dv=9, masked=masked, seed=8, dtype=torch.float32)

    def run(name):
        inputs = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
        out = ae.sigma_intention(*inputs, alpha=0.5, key_padding_mask=mask, backend=name)
        return out, torch.autograd.grad(out.square().sum(), inputs)

    (out, grads), (ref, ref_grads) = run("cpp"), run("reference")
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


def test_triton_backend_refuses_heads_beyond_its_tiles_with_the_reason():
    _skip_unless("triton")
    q, k, v, mask = problem(B=1, H=1, M=2, N=300, D=130, Dv=3, masked=True, seed=12, dtype=torch.float32)
    assert "D <= 128" in ae.available_backends(q, "intention", value_dim=3)["triton"]
    with pytest.raises(RuntimeError, match=r"backend 'triton' cannot run .*triton: the Triton kernels hold .* D = 130"):
        ae.intention(q, k, v, alpha=0.5, key_padding_mask=mask, backend="triton")
    # The automatic choice passes over it: here to the C++ kernel (on CUDA: the CUDA kernel, then the reference).
    torch.testing.assert_close(ae.intention(q, k, v, alpha=0.5, key_padding_mask=mask),
                               ae.intention(q, k, v, alpha=0.5, key_padding_mask=mask, backend="reference"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_non_contiguous_and_broadcast_inputs(backend, dtype):
    q, k, v, _ = problem(B=2, H=3, M=5, N=40, D=8, Dv=4, seed=14, dtype=dtype)
    # [B, N, H, D] storage seen as [B, H, N, D]: the row stride is H·D.
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    out = ae.intention(qt, kt, vt, alpha=0.3, backend=backend)
    torch.testing.assert_close(out, ae.intention(q, k, v, alpha=0.3, backend="reference"))
    # One key row repeated N times (stride 0 along N) is a legal input too. KᵀK is then rank one
    # (condition ~1e3 here), so fp32 is compared with the error of the same reference in fp32.
    k_rep, v_rep = k[:, :, :1].expand_as(k), v[:, :, :1].expand_as(v)
    out = ae.intention(q, k_rep, v_rep, alpha=0.3, backend=backend)
    exact = ae.intention(q.double(), k_rep.double(), v_rep.double(), alpha=0.3, backend="reference")
    baseline = ae.intention(q, k_rep.contiguous(), v_rep.contiguous(), alpha=0.3, backend="reference")
    err, ref_err = (out.double() - exact).abs().max().item(), (baseline.double() - exact).abs().max().item()
    assert err <= 2 * ref_err + 1e-12, (err, ref_err)


@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_scalars_for_alpha_and_scale_give_the_python_number_result(backend):
    q, k, v, mask = problem(N=12, D=4, masked=True, seed=15)
    for alpha, scale in ((np.float32(0.3), np.float64(0.7)), (np.float64(0.3), np.float16(0.5)),
                         (np.int64(2), np.int32(3)), (Fraction(1, 3), Fraction(3, 2))):
        for fn in (ae.intention, ae.sigma_intention):
            got = fn(q, k, v, alpha=alpha, scale=scale, key_padding_mask=mask, backend=backend)
            expected = fn(q, k, v, alpha=float(alpha), scale=float(scale), key_padding_mask=mask, backend=backend)
            assert torch.equal(got, expected), (fn.__name__, alpha, scale)
    state = ae.intention_state(k, v, key_padding_mask=mask)
    assert torch.equal(ae.intention_from_state(q, state, alpha=np.float32(0.5), scale=np.float64(2.0)),
                       ae.intention_from_state(q, state, alpha=0.5, scale=2.0))


@pytest.mark.parametrize("alpha", [True, np.bool_(False), "0.5", np.float64("nan"), np.float32(-1.0)])
def test_bool_and_bad_alpha_scalars_are_rejected(alpha):
    q, k, v, _ = problem(N=12, D=4)
    with pytest.raises(ValueError, match="alpha must be a finite float >= 0 or a tensor"):
        ae.intention(q, k, v, alpha=alpha)


@pytest.mark.parametrize("scale", [True, np.bool_(True), np.float32("inf"), None])
def test_bool_and_bad_scale_scalars_are_rejected(scale):
    q, k, v, _ = problem(N=12, D=4)
    with pytest.raises(ValueError, match="scale must be a finite float"):
        ae.intention_from_state(q, ae.intention_state(k, v), scale=scale)
    for fn in (ae.intention, ae.sigma_intention):  # None is cross attention's default, not Intention's
        with pytest.raises(ValueError, match="scale must be a finite float"):
            fn(q, k, v, scale=scale)
