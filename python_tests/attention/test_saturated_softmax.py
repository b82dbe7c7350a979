"""Saturated softmax rows: scores so large (|lse| >= 512) that the fp32 lse = max + log(sum) rounds
log(sum) away. The backward must not rebuild P = exp(s - lse) from it: two tied keys would each get
P = 1 and every gradient of the row would double.
"""
from __future__ import annotations

import pytest
import torch

import attn_ext as ae
from _helpers import require_backend

CASES = [("cpp", torch.float32), ("cpp", torch.float64), ("reference", torch.float32), ("reference", torch.float64),
         ("triton", torch.float32)]  # Triton takes no fp64


@pytest.mark.parametrize("backend,dtype", CASES)
@pytest.mark.parametrize("magnitude", [3e7, 1e30])
def test_tied_keys_of_a_saturated_row_share_the_weight(backend, dtype, magnitude):
    q = torch.zeros(2, 1, 3, 2, dtype=dtype)
    q[..., 0] = magnitude  # every row saturated; keys 0 and 1 tie for the top score
    k = torch.tensor([[1.0, 0.3], [1.0, -0.2], [0.5, 1.0]], dtype=dtype).expand(2, 1, 3, 2)
    v = torch.tensor([[1.0], [3.0], [-2.0]], dtype=dtype).expand(2, 1, 3, 1)
    require_backend(backend, q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = ae.cross_attention(*leaves, scale=1.0, return_lse=True, backend=backend)
    grad_v = torch.autograd.grad(out.sum() + 0 * lse.sum(), leaves[2])[0]
    torch.testing.assert_close(out, torch.full_like(out, 2.0))
    expected = torch.tensor([[1.5], [1.5], [0.0]], dtype=dtype).expand(2, 1, 3, 1)  # 3 rows × P = 1/2
    torch.testing.assert_close(grad_v, expected)
