"""Bad arguments of ``ae.te_attention`` and of its ops called directly: errors that name the op and the shapes,
dtypes or values they got, the same from the Python front end and the C++ op."""
from __future__ import annotations

import pytest
import torch

import attn_ext as ae
from attn_ext.ops.utils.extension import extension_error
from python_tests.te_attention._te_problems import make_problem


def _problem():
    return make_problem(2, 2, 3, 5, 4, 3, 2, 6)


@pytest.mark.parametrize("index, bad, match", [
    (0, torch.zeros(2, 3, 4), "expected q \\[B, H, M, D\\]"),
    (1, torch.zeros(2, 2, 5, 3, dtype=torch.float64), "one B, H, M, N, D and dx"),
    (4, torch.zeros(2, 6, 2, dtype=torch.float64), "one B, H, M, N, D and dx"),
    (5, torch.zeros(6, 3, dtype=torch.float64), "w1 \\[hidden, H \\+ dx\\] = \\[hidden, 4\\]"),
    (7, torch.zeros(2, 5, dtype=torch.float64), "w2 \\[H, hidden\\]"),
    (2, torch.zeros(2, 2, 5, 3, dtype=torch.float32), "share one dtype"),
])
def test_bad_tensors(index, bad, match):
    problem = _problem()
    problem[index] = bad
    with pytest.raises((ValueError, TypeError), match="attn_ext.te_attention: .*" + match):
        ae.te_attention(*problem)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)), ValueError, "key_padding_mask must be \\[B, N\\]"),
    (dict(key_padding_mask=torch.zeros(2, 5)), TypeError, "key_padding_mask must be bool"),
    (dict(activation="softplus"), ValueError, "unknown activation 'softplus'"),
    (dict(scale=float("nan")), ValueError, "scale must be a finite float"),
    (dict(chunk_size=-1), ValueError, "chunk_size must be >= 0"),
    (dict(backend="triton"), RuntimeError, "Triton kernels take float16, bfloat16 or float32, not float64"),
    (dict(backend="fast"), ValueError, "unknown backend 'fast'"),
    (dict(backend="cuda"), RuntimeError, "cuda"),
])
def test_bad_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        ae.te_attention(*_problem(), **kwargs)


def test_integer_inputs_are_refused():
    problem = [t.long() for t in _problem()]
    with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64"):
        ae.te_attention(*problem)


@pytest.mark.skipif(extension_error() is not None, reason=f"attn_ext._C is not loaded: {extension_error()}")
@pytest.mark.parametrize("op", ["te_attention_fwd", "te_attention_fwd_reference"])
def test_direct_op_calls_check_too(op):
    problem = _problem()
    fn = getattr(torch.ops.attn_ext, op)
    with pytest.raises(ValueError, match="activation must be 0 \\(relu\\), 1 \\(gelu\\), 2 \\(silu\\) or 3 \\(tanh\\)"):
        fn(*problem, None, 0.5, 7, 0)
    problem[5] = torch.zeros(6, 9, dtype=torch.float64)
    with pytest.raises(ValueError, match="attn_ext.te_attention: the MLP's weights"):
        fn(*problem, None, 0.5, 0, 0)


@pytest.mark.skipif(extension_error() is not None, reason=f"attn_ext._C is not loaded: {extension_error()}")
def test_backward_op_checks_its_gradients():
    problem = _problem()
    out, lse = torch.ops.attn_ext.te_attention_fwd(*problem, None, 0.5, 0, 0)
    with pytest.raises(ValueError, match="attn_ext.te_attention \\(backward\\): grad_out and out must be"):
        torch.ops.attn_ext.te_attention_bwd(out[:, :1], torch.zeros_like(lse), *problem, None, out, lse, 0.5, 0, 0)
