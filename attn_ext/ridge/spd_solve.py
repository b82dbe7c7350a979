"""Batched solves with small symmetric positive-definite matrices, factor and solve fused (SPEC §4).

``X = A⁻¹ B`` per matrix by a Cholesky factorisation whose factor never leaves the thread's cache:
for a batch of many small systems the factor-then-solve pair (:func:`batched_cholesky`,
:func:`batched_cholesky_solve`) spends as long writing and re-reading ``L`` (and faulting in its
fresh pages) as computing it. Unlike those two, this op is differentiable:

* ``dB = A⁻¹ dX`` (one more fused solve),
* ``dA = tril(G + Gᵀ) − diag(G)`` with ``G = −dB Xᵀ``, because only A's lower triangle is read (the
  upper one gets a zero gradient, as for :func:`torch.linalg.cholesky`).

The backward is written with differentiable ops, so double backward works too.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from attn_ext.ridge.cholesky import _check_matrix_and_rhs, _require_extension
from attn_ext._extension import extension_error

__all__ = ["batched_spd_solve"]


def _check_args(A: Tensor, B: Tensor) -> None:
    _check_matrix_and_rhs("batched_spd_solve", "A", A, B)


def batched_spd_solve(A: Tensor, B: Tensor, *, check_errors: bool = True) -> Tensor:
    """Solves ``A X = B`` for a batch of small symmetric positive-definite matrices.

    The Cholesky factorisation and both triangular solves run per matrix with the factor kept in
    cache, so only X is written: the same result as
    ``torch.cholesky_solve(B, torch.linalg.cholesky(A))`` without materialising the factors.

    Parameters
    ----------
    A : Tensor, shape (..., n, n)
        Symmetric positive definite, float32 or float64, on the CPU; any strides. Only the lower
        triangle is read (and receives a gradient), as :func:`torch.linalg.cholesky` does.
    B : Tensor, shape (..., n, r)
        Right-hand sides with A's batch dimensions and dtype (no broadcasting).
    check_errors : bool
        Raise ``ValueError`` naming the first matrix that is not positive definite (default). With
        False, such matrices get an all-NaN X instead, and the caller checks ``isnan``.

    Returns
    -------
    X : Tensor, shape (..., n, r)
        Contiguous, in A's dtype; differentiable with respect to A and B.

    Raises
    ------
    ValueError
        Shapes do not match, or (with ``check_errors``) a matrix is not positive definite.
    TypeError
        A or B is not float32/float64, or their dtypes differ.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.ridge import batched_spd_solve
    >>> A = torch.tensor([[[4.0, 2.0], [2.0, 5.0]]])
    >>> batched_spd_solve(A, torch.tensor([[[6.0, 2.0], [7.0, 2.0]]]))
    tensor([[[1.0000, 0.3750],
             [1.0000, 0.2500]]])
    """
    _check_args(A, B)
    _require_extension()
    X, info = torch.ops.attn_ext.batched_spd_solve(A, B)
    if check_errors and info.numel() > 0:
        failed = torch.nonzero(info)
        if failed.numel() > 0:
            index = tuple(failed[0].tolist())
            raise ValueError(f"attn_ext.batched_spd_solve: A{list(index)} (of batch shape {tuple(A.shape[:-2])}) is "
                             f"not positive definite: the pivot of column {int(info[index]) - 1} is not positive "
                             "and finite")
    return X


def _fake(A: Tensor, B: Tensor) -> Tuple[Tensor, Tensor]:
    _check_args(A, B)
    return B.new_empty(B.shape), A.new_empty(A.shape[:-2], dtype=torch.int32)


def _setup_context(ctx, inputs, output) -> None:
    A, _ = inputs
    X, info = output
    ctx.mark_non_differentiable(info)
    ctx.save_for_backward(A, X)


def _backward(ctx, grad_x: Tensor, _grad_info) -> Tuple[Tensor, Tensor]:
    A, X = ctx.saved_tensors
    if grad_x is None:
        return None, None
    grad_b = torch.ops.attn_ext.batched_spd_solve(A, grad_x.contiguous())[0]
    g = -(grad_b @ X.mT)
    grad_a = (g + g.mT).tril() - torch.diag_embed(g.diagonal(dim1=-2, dim2=-1))
    return grad_a, grad_b


def _cuda_composition(A: Tensor, B: Tensor) -> Tuple[Tensor, Tensor]:
    """CUDA: the batched Cholesky then solve kernels (no fused CUDA kernel yet), NaN where A is not SPD."""
    L, info = torch.ops.attn_ext.batched_cholesky(A)
    X = torch.ops.attn_ext.batched_cholesky_solve(L, B)
    return X.masked_fill((info != 0)[..., None, None], float("nan")), info


if extension_error() is None:
    if torch._C._dispatch_has_kernel_for_dispatch_key("attn_ext::batched_cholesky", "CUDA"):
        torch.library.impl("attn_ext::batched_spd_solve", "CUDA")(_cuda_composition)
    torch.library.register_fake("attn_ext::batched_spd_solve")(_fake)
    torch.library.register_autograd("attn_ext::batched_spd_solve", _backward, setup_context=_setup_context)
