"""Scores out of the accumulation dtype's range (docs/sdpa.md, "Scores out of range"): a call whose fp64
answer is finite but whose float32 scores or value sums overflow raises an error naming the op, on
every backend, where it used to return NaN (``scale = 1e38``) or, worse, the ``0`` of a row with no key
(every scaled score below −3.4e38). Rows that are NaN or empty by the NaN rule, and float64 inputs that
do not overflow, are unchanged.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

import attn_ext as ae
from _helpers import ALL_BACKENDS, require_backend

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's, in the Triton interpreter

F32, F64 = torch.float32, torch.float64
OVERFLOW = r"leave the range of float32 .* although its inputs are finite"


def _ops(backend):
    """(op name, f(q, k, v, scale, key_padding_mask) -> (out, lse))."""
    return [
        ("cross_attention", lambda q, k, v, scale, mask=None: ae.cross_attention(
            q, k, v, scale=scale, key_padding_mask=mask, return_lse=True, backend=backend)),
        ("scaled_dot_product_attention", lambda q, k, v, scale, mask=None: ae.scaled_dot_product_attention(
            q, k, v, scale=scale, key_padding_mask=mask, return_lse=True, backend=backend)),
    ]


def _reference(q, k, v, scale):
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    return torch.softmax(scores, -1) @ v.double(), torch.logsumexp(scores, -1)


def _problem(first_coordinate_of_keys):
    """One query e₁ over keys whose q·k are the given values; values 1, 2, 3, ... ."""
    n = len(first_coordinate_of_keys)
    q = torch.zeros(1, 1, 1, 4, dtype=F32)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, n, 4, dtype=F32)
    k[0, 0, :, 0] = torch.tensor(first_coordinate_of_keys)
    v = torch.arange(1.0, n + 1, dtype=F32).view(1, 1, n, 1).expand(1, 1, n, 2).contiguous()
    return q, k, v


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("keys", [[1.0, 4.0, -2.0], [-5.0, -4.0, -6.0]], ids=["score_above", "every_score_below"])
def test_scores_beyond_float32_raise_naming_the_op(backend, keys):
    # scale = 1e38: the scaled scores 4e38 (+inf in float32) or -4e38 ... -6e38 (all -inf: it looked
    # like a row with no key and returned 0). The fp64 answers are finite: v of the largest score.
    q, k, v = _problem(keys)
    require_backend(backend, q)
    expected, lse = _reference(q, k, v, 1e38)
    assert torch.isfinite(expected).all() and torch.isfinite(lse).all()
    for name, f in _ops(backend):
        with pytest.raises(ValueError, match=rf"attn_ext\.{name}: .*{OVERFLOW}"):
            f(q, k, v, 1e38)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_value_sums_beyond_float32_are_right_or_raise(backend):
    # Two equally weighted values of 3e38: the mean 3e38 is a float32, their sum is not.
    q, k, _ = _problem([1.0, 1.0])
    v = torch.full((1, 1, 2, 2), 3e38, dtype=F32)
    require_backend(backend, q)
    for name, f in _ops(backend):
        try:
            out, _ = f(q, k, v, 1.0)
        except ValueError as error:
            assert re.search(rf"attn_ext\.{name}: .*{OVERFLOW}", str(error)), str(error)
        else:
            torch.testing.assert_close(out.double(), torch.full((1, 1, 1, 2), 3e38, dtype=F64), rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_the_nan_rule_and_empty_rows_are_not_overflows(backend):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 3, 4, generator=g), torch.randn(2, 2, 5, 4, generator=g),
               torch.randn(2, 2, 5, 2, generator=g))
    require_backend(backend, q)
    q[0, 1, 2, 0] = math.nan           # its row is NaN (the NaN rule)
    k[0, 0, 4, 1] = math.nan           # an allowed key holding NaN: every row of (0, 0) is NaN
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[1] = True                     # batch entry 1 has no key: 0 and lse = -inf
    for name, f in _ops(backend):
        out, lse = f(q, k, v, 1e30, mask)  # a large scale whose scores stay within float32
        assert torch.isnan(out[0, 1, 2]).all() and torch.isnan(lse[0, 1, 2]), name
        assert torch.isnan(out[0, 0]).all() and torch.isnan(lse[0, 0]).all(), name
        assert (out[1] == 0).all() and torch.isneginf(lse[1]).all(), name
        assert torch.isfinite(out[0, 1, :2]).all() and torch.isfinite(lse[0, 1, :2]).all(), name


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_float64_computes_what_float32_refuses(backend):
    q, k, v = _problem([1.0, 4.0, -2.0])
    q, k, v = q.double(), k.double(), v.double()
    expected, expected_lse = _reference(q, k, v, 1e38)
    for name, f in _ops(backend):
        out, lse = f(q, k, v, 1e38)
        torch.testing.assert_close(out, expected.to(out.dtype), msg=name)
        torch.testing.assert_close(lse, expected_lse, msg=name)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_large_finite_scores_in_range_still_compute(backend):
    # scale = 1e37: scores up to 4e37 fit in float32; the answer and its gradient are exact.
    q, k, v = _problem([1.0, 4.0, -2.0])
    require_backend(backend, q)
    expected, expected_lse = _reference(q, k, v, 1e37)
    for name, f in _ops(backend):
        out, lse = f(q, k, v, 1e37)
        torch.testing.assert_close(out.double(), expected, msg=name)
        torch.testing.assert_close(lse.double(), expected_lse, rtol=1e-6, atol=0, msg=name)
