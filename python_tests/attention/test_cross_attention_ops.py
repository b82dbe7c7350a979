"""The torch.library side of cross attention: opcheck of every op, torch.compile, determinism of the
cpp kernels, and backend selection (argument, environment variable, automatic, rejections)."""
import math

import pytest
import torch

import attn_ext as ae
from attn_ext.ops.utils import dispatch
from attn_ext.ops.utils.dispatch import BACKENDS, ENVIRONMENT_VARIABLE
from _helpers import ALL_BACKENDS, make_mask, make_qkv, require_backend

# --------------------------------------------------------------------------------------------- opcheck

OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _opcheck_inputs(backend, dtype, with_mask):
    q, k, v = make_qkv(2, 2, 3, 11, 8, 5, dtype=dtype, seed=1)
    mask = make_mask("all_padded", 2, 11) if with_mask else None
    require_backend(backend, q)
    return q, k, v, mask


def _dtypes(backend):
    return (torch.float32,) if backend == "triton" else (torch.float32, torch.float64)


OPCHECK_CASES = [(b, dt, m) for b in ALL_BACKENDS for dt in _dtypes(b) for m in (False, True)]
OPCHECK_IDS = [f"{b}-{str(dt)[6:]}-{'mask' if m else 'nomask'}" for b, dt, m in OPCHECK_CASES]


@pytest.mark.parametrize("backend,dtype,with_mask", OPCHECK_CASES, ids=OPCHECK_IDS)
def test_opcheck_forward_op(backend, dtype, with_mask):
    q, k, v, mask = _opcheck_inputs(backend, dtype, with_mask)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    torch.library.opcheck(dispatch.kernel("cross_attention", backend), (q, k, v, mask, 0.4, 4), test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("backend,dtype,with_mask", OPCHECK_CASES, ids=OPCHECK_IDS)
def test_opcheck_backward_op(backend, dtype, with_mask):
    q, k, v, mask = _opcheck_inputs(backend, dtype, with_mask)
    out, lse = dispatch.kernel("cross_attention", backend)(q, k, v, mask, 0.4, 4)
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    args = (grad_out, grad_lse, q, k, v, mask, out, lse, 0.4, 4)
    torch.library.opcheck(dispatch.backward_kernel("cross_attention", backend), args, test_utils=OPCHECK_TESTS)


def test_every_backend_has_registered_ops():
    for backend in BACKENDS:
        for op in ("cross_attention", "merge_states"):
            assert dispatch.kernel(op, backend) is not None and dispatch.backward_kernel(op, backend) is not None, (op, backend)


# --------------------------------------------------------------------------------------------- compile


def _loss(q, k, v, mask):
    out, lse = ae.cross_attention(q, k, v, key_padding_mask=mask, return_lse=True, backend="cpp", chunk_size=4)
    return (out * out).sum() + torch.where(torch.isinf(lse), 0.0, lse).sum()


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph_forward_and_backward(dynamic):
    torch._dynamo.reset()
    q, k, v = make_qkv(2, 2, 5, 13, 8, 6, dtype=torch.float32, seed=2)
    mask = make_mask("all_padded", 2, 13)
    require_backend("cpp", q)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    compiled_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    expected = _loss(*leaves, mask)
    expected.backward()
    compiled = torch.compile(_loss, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    got = compiled(*compiled_leaves, mask)
    got.backward()
    torch.testing.assert_close(got, expected)
    for a, b in zip(compiled_leaves, leaves):
        torch.testing.assert_close(a.grad, b.grad)


def test_torch_compile_fullgraph_inductor_automatic_backend():
    torch._dynamo.reset()
    q, k, v = make_qkv(1, 2, 4, 9, 8, dtype=torch.float32, seed=3)
    compiled = torch.compile(lambda q, k, v: ae.cross_attention(q, k, v) * 2.0, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), ae.cross_attention(q, k, v) * 2.0)


# --------------------------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("B,H,M,N", [(1, 1, 1, 5000), (1, 1, 3, 5000), (2, 3, 113, 700)])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=lambda d: str(d)[6:])
def test_cpp_is_deterministic(dtype, B, H, M, N):
    q, k, v = make_qkv(B, H, M, N, 64, 32, dtype=dtype, seed=5)
    mask = make_mask("random", B, N)
    require_backend("cpp", q)
    gen = torch.Generator().manual_seed(6)
    grad_out = torch.randn(B, H, M, 32, generator=gen).to(dtype)
    grad_lse = torch.randn(B, H, M, generator=gen)

    def run():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, lse = ae.cross_attention(*leaves, key_padding_mask=mask, return_lse=True, backend="cpp", chunk_size=64)
        grads = torch.autograd.grad((out, lse), leaves, (grad_out, grad_lse))
        return (out, lse, *grads)

    first, second = run(), run()
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} differs between two identical runs"


# --------------------------------------------------------------------------------------------- selection


@pytest.fixture
def used_backends(monkeypatch):
    """Names of the backends whose forward op ae.cross_attention called."""
    calls = []
    real = dispatch.entry

    def spy(op, name):
        if op == "cross_attention":
            calls.append(name)
        return real(op, name)

    monkeypatch.setattr(dispatch, "entry", spy)
    return calls


def _small():
    return make_qkv(1, 1, 2, 3, 4, dtype=torch.float32)


def test_automatic_choice_on_cpu_is_cpp(used_backends):
    q, k, v = _small()
    require_backend("cpp", q)
    ae.cross_attention(q, k, v)
    ae.cross_attention(q, k, v, backend="auto")
    assert used_backends == ["cpp", "cpp"]


@pytest.mark.parametrize("name", ["reference", "cpp", "triton"])
def test_environment_variable_is_honoured(monkeypatch, used_backends, name):
    q, k, v = _small()
    require_backend(name, q)
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, name)
    ae.cross_attention(q, k, v)
    ae.cross_attention(q, k, v, backend="auto")
    assert used_backends == [name, name]


def test_explicit_backend_wins_over_environment(monkeypatch, used_backends):
    q, k, v = _small()
    require_backend("cpp", q)
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, "reference")
    ae.cross_attention(q, k, v, backend="cpp")
    assert used_backends == ["cpp"]


def test_environment_auto_means_automatic(monkeypatch, used_backends):
    q, k, v = _small()
    require_backend("cpp", q)
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, "auto")
    ae.cross_attention(q, k, v)
    assert used_backends == ["cpp"]


def test_available_backends_reports_every_backend():
    q, _, _ = _small()
    reasons = ae.available_backends(q)
    assert set(reasons) == set(BACKENDS)
    assert reasons["reference"] is None
    assert all(r is None or (isinstance(r, str) and r) for r in reasons.values())
    assert ae.available_backends(q.double())["triton"] is not None  # triton takes no fp64


def test_forced_unavailable_backend_lists_every_reason(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # triton now cannot run CPU tensors
    q, k, v = _small()
    reasons = ae.available_backends(q)
    assert reasons["triton"] is not None
    with pytest.raises(RuntimeError, match=r"backend 'triton' cannot run") as info:
        ae.cross_attention(q, k, v, backend="triton")
    message = str(info.value)
    for name, reason in reasons.items():
        assert f"{name}: {reason or 'available'}" in message


def test_forced_unavailable_backend_from_environment_raises(monkeypatch):
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, "triton")
    q, k, v = (t.double() for t in _small())
    reason = ae.available_backends(q)["triton"]  # "... not float64" when Triton itself can run
    with pytest.raises(RuntimeError, match=r"backend 'triton' cannot run on cpu torch.float64 inputs") as info:
        ae.cross_attention(q, k, v)
    assert f"triton: {reason}" in str(info.value)


def test_unavailable_cpp_is_reported_and_automatic_falls_back(monkeypatch, used_backends):
    from attn_ext.ops.utils import extension

    monkeypatch.setattr(extension, "extension_error", lambda: "attn_ext._C could not be imported (test)")
    q, k, v = _small()
    with pytest.raises(RuntimeError, match=r"cpp: attn_ext\._C could not be imported \(test\)"):
        ae.cross_attention(q, k, v, backend="cpp")
    ae.cross_attention(q, k, v)
    assert used_backends == ["reference"]


@pytest.mark.parametrize("where", ["argument", "environment"])
def test_unknown_backend_name_raises_value_error(monkeypatch, where):
    q, k, v = _small()
    kwargs = {}
    if where == "argument":
        kwargs["backend"] = "cuda_magic"
    else:
        monkeypatch.setenv(ENVIRONMENT_VARIABLE, "cuda_magic")
    with pytest.raises(ValueError, match=r"unknown backend 'cuda_magic'; choose one of cpp, cuda, triton, reference or 'auto'"):
        ae.cross_attention(q, k, v, **kwargs)


def test_backend_results_agree_through_public_api():
    q, k, v = make_qkv(2, 2, 7, 50, 16, 8, dtype=torch.float32, seed=8)
    mask = make_mask("all_padded", 2, 50)
    results = {}
    for name in ALL_BACKENDS:
        if ae.available_backends(q)[name] is None:
            results[name] = ae.cross_attention(q, k, v, key_padding_mask=mask, return_lse=True, backend=name)
    assert "reference" in results
    for name, (out, lse) in results.items():
        torch.testing.assert_close(out, results["reference"][0], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(lse, results["reference"][1], rtol=1e-5, atol=1e-6, msg=name)
        assert bool((lse[0] == -math.inf).all()), name
