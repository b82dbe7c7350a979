"""``ae.te_attention`` on the Triton backend (the interpreter on this machine, a GPU where there is one) against
the fp64 dense formula with FlashAttention's rule: our error at most 2x (gradients 3x) that of the dense formula
in the inputs' precision, plus a rounding floor; over tiles cut by the sizes (M, N off 16, three heads in a tile of
four, hidden widths off the 16-unit chunks), sizes 0, padding (NaN behind it reaching nothing) and fp16/bf16."""
from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import attn_ext as ae
from python_tests._helpers import require_backend
from python_tests.te_attention._te_problems import check_flash_rule, make_mask, make_problem

SHAPES = [  # (B, H, M, N, D, Dv, dx, hidden)
    (2, 2, 5, 9, 4, 3, 2, 6),
    (1, 3, 20, 37, 5, 7, 1, 20),
    (2, 1, 1, 1, 3, 2, 3, 4),
    (1, 2, 3, 5, 0, 3, 1, 3),
    (1, 2, 3, 5, 2, 0, 1, 3),
    (2, 2, 4, 0, 4, 4, 2, 5),
    (1, 2, 0, 7, 4, 4, 2, 5),
]


def _check(shape, dtype, mask_kind="padding", activation="relu", seed=0):
    low = [t.to(dtype).requires_grad_() for t in make_problem(*shape, seed=seed)]
    require_backend("triton", low[0])
    check_flash_rule("triton", low, make_mask(shape[0], shape[3], mask_kind), activation, seed, label=str(shape))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp32_forward_and_gradients(shape):
    _check(shape, torch.float32)


@pytest.mark.parametrize("activation", ["gelu", "silu", "tanh"])
def test_activations(activation):
    _check((1, 2, 17, 19, 4, 4, 2, 7), torch.float32, activation=activation)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    _check((2, 2, 18, 21, 8, 8, 2, 16), dtype, mask_kind="one_entry_all_padded")


def test_nan_behind_padding_reaches_nothing():
    problem = make_problem(2, 2, 5, 9, dtype=torch.float32)
    require_backend("triton", problem[0])
    mask = make_mask(2, 9, "padding")
    for b in range(2):
        problem[1][b, :, mask[b]] = float("nan")
        problem[2][b, :, mask[b]] = float("inf")
        problem[4][b, mask[b]] = float("nan")
    problem = [t.requires_grad_() for t in problem]
    out, lse = ae.te_attention(*problem, key_padding_mask=mask, return_lse=True, backend="triton")
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    grads = torch.autograd.grad(out.sum() + lse.sum(), problem)
    assert all(torch.isfinite(g).all() for g in grads)


def test_a_nan_query_gives_its_row_nan():
    problem = make_problem(2, 2, 5, 9, dtype=torch.float32)
    require_backend("triton", problem[0])
    problem[3][1, 2, 0] = float("nan")
    out = ae.te_attention(*problem, backend="triton")
    assert torch.isnan(out[1, :, 2]).all() and torch.isfinite(out[0]).all() and torch.isfinite(out[1, :, :2]).all()


def test_opcheck():
    problem = make_problem(2, 2, 3, 6, 3, 2, 2, 5, dtype=torch.float32)
    require_backend("triton", problem[0])
    opcheck(torch.ops.attn_ext.te_attention_fwd_triton.default, (*problem, make_mask(2, 6, "padding"), 0.5, 0, 0))


def test_float64_is_refused_with_the_reason():
    problem = make_problem(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match="triton.*float64"):
        ae.te_attention(*problem, backend="triton")
