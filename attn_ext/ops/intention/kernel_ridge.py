"""The exact kernelised Intention solved as kernel ridge regression: ``k(Q, K) (k(K, K) + αI)⁻¹ V``.

With every key as a landmark, Intention on the features ``φ(X) = k(X, K) k(K, K)^{-1/2}`` equals
kernel ridge regression (push-through identity). Built through the features it needs ``k(K, K)``
itself to be numerically positive definite, which it is not for a few hundred RBF keys in a few
dimensions (its spectrum decays to rounding level). Solved directly, the system is
``k(K, K) + αI``: positive definite for any ``α > 0``, so the exact form answers without a jitter.
Only ``α = 0`` (interpolation) still needs an invertible kernel matrix, and is refused otherwise.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from attn_ext.ops.intention import naive as reference
from attn_ext.ops.intention.kernel_features import (
    check_factorised_in_graph,
    first_failure,
    kernel_matrix,
    tiny_pivots_as_failures,
)


def kernel_ridge(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, key_padding_mask: Optional[Tensor], kernel: str,
                 lengthscale: Tensor, op: str) -> Tensor:
    """``k(Q, K) (k(K, K) + αI)⁻¹ V`` per (batch, head) over the valid keys; ``alpha [B, H]``.

    ``k`` and ``v`` must already hold zeros at padding keys. A padding key's row and column of the
    system are the identity's (times ``1 + α``) and its value is 0, so its weight solves to 0 and its
    kernel with the queries is never used. A NaN/inf valid key or value makes its (batch, head) NaN,
    a NaN/inf query row its row. A system that is not numerically positive definite (only possible
    for ``α`` at or near 0) raises ``RuntimeError`` naming ``op`` and the (batch, head).
    """
    B, H, N = k.shape[:3]
    pad = (torch.zeros(B, N, dtype=torch.bool, device=k.device) if key_padding_mask is None
           else key_padding_mask)[:, None, :]                                            # [B, 1, N]
    gram = kernel_matrix(k, k, kernel, lengthscale)
    eye = torch.eye(N, dtype=gram.dtype, device=gram.device)
    gram = torch.where(pad[..., :, None] | pad[..., None, :], eye, gram)
    nan = reference.nan_unless_finite(gram, (-2, -1)) + reference.nan_unless_finite(v, (-2, -1))
    nonfinite = torch.isnan(nan)
    system = torch.where(nonfinite[..., None, None], eye, gram + alpha[..., None, None] * eye)
    factor, info = torch.linalg.cholesky_ex(system)
    tolerance = N * torch.finfo(system.dtype).eps
    info = tiny_pivots_as_failures(factor, system, info)
    check_factorised_in_graph(info, nonfinite, f"attn_ext.{op}: the kernel ridge system k(K, K) + αI is not positive "
                              "definite: with alpha = 0 the kernel matrix itself must be invertible; pass alpha > 0")
    failed = first_failure(info, nonfinite)
    if failed is not None:
        (b, h), column = failed
        raise RuntimeError(
            f"attn_ext.{op}: the kernel ridge system k(K, K) + αI is not positive definite at [batch, head] = "
            f"[{b}, {h}] (Cholesky pivot of column {column}, tolerance {tolerance:.1e} times its largest diagonal "
            "entry): with alpha = 0 (interpolation) the kernel matrix itself must be invertible, and duplicated "
            "or nearly equal keys, many keys in few dimensions or a large lengthscale make it numerically "
            "singular. Pass alpha > 0 (kernel ridge regression, always solvable), or num_landmarks")
    weights = torch.cholesky_solve(torch.where(nonfinite[..., None, None], torch.zeros_like(v), v), factor)
    cross = kernel_matrix(q, k, kernel, lengthscale).masked_fill(pad[:, :, None, :], 0.0)
    return cross @ weights + nan[..., None, None]
