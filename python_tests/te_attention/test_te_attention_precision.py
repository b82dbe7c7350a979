"""``ae.te_attention`` in fp32, fp16 and bf16 against the fp64 dense formula with FlashAttention's rule: our error
at most 2x (gradients 3x) that of the dense formula computed by PyTorch in the inputs' precision, plus a rounding
floor; and a hypothesis property over shapes and padding in fp64."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attn_ext as ae
from python_tests._helpers import require_backend
from python_tests.te_attention._te_problems import check_flash_rule, dense, flash_rule_grads, make_mask, make_problem

@pytest.mark.parametrize("backend", ["cpp", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_flash_attention_rule(backend, dtype):
    low = [t.to(dtype).requires_grad_() for t in make_problem(2, 4, 20, 70, 8, 8, 2, 16, seed=11)]
    require_backend(backend, low[0])
    check_flash_rule(backend, low, make_mask(2, 70, "padding"), seed=1)


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 3), M=st.integers(0, 20), N=st.integers(0, 70), D=st.integers(1, 5),
       Dv=st.integers(1, 4), dx=st.integers(1, 3), hidden=st.integers(1, 9), mask_kind=st.sampled_from(
           ["none", "padding", "one_entry_all_padded"]), activation=st.sampled_from(["relu", "gelu", "silu", "tanh"]),
       seed=st.integers(0, 1000))
def test_property_cpp_equals_the_dense_formula(B, H, M, N, D, Dv, dx, hidden, mask_kind, activation, seed):
    problem = [t.requires_grad_() for t in make_problem(B, H, M, N, D, Dv, dx, hidden, seed=seed)]
    mask = make_mask(B, N, mask_kind, seed)
    out, lse = ae.te_attention(*problem, key_padding_mask=mask, activation=activation, return_lse=True, backend="cpp")
    ref_out, ref_lse = dense(problem, mask, activation)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-12)
    g = torch.Generator().manual_seed(seed)
    grad_out, grad_lse = torch.randn(out.shape, generator=g, dtype=out.dtype), torch.randn(lse.shape, generator=g,
                                                                                           dtype=lse.dtype)
    for a, b in zip(flash_rule_grads(out, lse, problem, grad_out, grad_lse), flash_rule_grads(ref_out, ref_lse, problem, grad_out,
                                                                          grad_lse)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
