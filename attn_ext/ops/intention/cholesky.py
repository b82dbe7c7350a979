"""Batched Cholesky factorisation and solves of small SPD matrices (docs/spec.md §4), under the Intention op.

The Intention op ``Q (KᵀK + αI)⁻¹ KᵀV`` factors one D×D matrix per batch and head and solves with it
in the forward pass and once more in the backward pass; ``batched_cholesky`` and
``batched_cholesky_solve`` do that for a whole batch at once, and ``batched_spd_solve`` both at once
with the factor kept in cache. Compiled kernels only (C++ on CPU, CUDA in CUDA builds): their fake
kernels and autograd formulas are in :mod:`.registration`. The factor and the solve are not
differentiable on purpose (the Intention backward differentiates through the factor by hand, with
one more solve with the saved L); ``batched_spd_solve`` is.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from attn_ext.ops.intention.cholesky_checks import check_dtype_and_device, check_matrix_and_rhs, check_square
from attn_ext.ops.intention.registration import BATCHED_CHOLESKY, BATCHED_CHOLESKY_SOLVE, BATCHED_SPD_SOLVE
from attn_ext.ops.utils.autograd import functorch_entry
from attn_ext.ops.utils.concrete import check_on_device, concrete, tracing

__all__ = ["batched_cholesky", "batched_cholesky_solve", "batched_spd_solve"]


def _check_solve_args(L: Tensor, B: Tensor) -> None:
    check_matrix_and_rhs(BATCHED_CHOLESKY_SOLVE, "L", L, B)


def batched_cholesky(A: Tensor) -> Tuple[Tensor, Tensor]:
    """Lower Cholesky factors of a batch of small symmetric positive-definite matrices.

    ``A = L Lᵀ`` per matrix, like :func:`torch.linalg.cholesky_ex` but register-blocked for the small
    matrices (n ≲ 128) of the Intention op, with the whole batch in one call.

    Parameters
    ----------
    A : Tensor, shape (..., n, n)
        float32 or float64, on the CPU; any strides. Only the lower triangle is read, as
        :func:`torch.linalg.cholesky` does.

    Returns
    -------
    L : Tensor, shape (..., n, n)
        Lower triangular (zeros above the diagonal), contiguous, in A's dtype.
    info : Tensor, int32, shape (...)
        0 where the factorisation succeeded; ``j + 1`` where the pivot of column ``j`` was not
        positive and finite (A not positive definite, or NaN/inf in it), as LAPACK and
        :func:`torch.linalg.cholesky_ex` report it. There, L's columns ``< j`` are the factor's and
        the others are zero. Nothing is raised for such matrices: check ``info``.

    Raises
    ------
    ValueError
        A is not a batch of square matrices.
    TypeError
        A is not float32 or float64 (half precision is refused, not upcast).

    Examples
    --------
    >>> import torch
    >>> from attn_ext.ops.intention import batched_cholesky
    >>> A = torch.tensor([[[4.0, 2.0], [2.0, 5.0]], [[1.0, 2.0], [2.0, 1.0]]])
    >>> L, info = batched_cholesky(A)
    >>> L[0]
    tensor([[2., 0.],
            [1., 2.]])
    >>> info  # the second matrix is indefinite: its pivot at column 1 is 1 - 2² < 0
    tensor([0, 2], dtype=torch.int32)
    """
    check_square(BATCHED_CHOLESKY, "A", A)
    check_dtype_and_device(BATCHED_CHOLESKY, "A", A)
    return torch.ops.attn_ext.batched_cholesky(A)


def batched_cholesky_solve(L: Tensor, B: Tensor) -> Tensor:
    """Solves ``(L Lᵀ) X = B`` for a batch of Cholesky factors and blocks of right-hand sides.

    A forward substitution ``L Y = B`` then a back substitution ``Lᵀ X = Y``, all ``r`` right-hand
    sides at once; the same result as ``torch.cholesky_solve(B, L)``, without broadcasting.

    Parameters
    ----------
    L : Tensor, shape (..., n, n)
        Lower-triangular factors, e.g. from :func:`batched_cholesky`; only the lower triangle is
        read. float32 or float64, on the CPU.
    B : Tensor, shape (..., n, r)
        Right-hand sides, with the batch dimensions and dtype of L.

    Returns
    -------
    X : Tensor, shape (..., n, r)
        Contiguous, in L's dtype. A zero on L's diagonal gives inf/NaN, as in LAPACK.

    Raises
    ------
    ValueError
        L is not square, or B's batch dimensions or row count do not match L's.
    TypeError
        L or B is not float32/float64, or their dtypes differ.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.ops.intention import batched_cholesky, batched_cholesky_solve
    >>> A = torch.tensor([[[4.0, 2.0], [2.0, 5.0]]])
    >>> L, info = batched_cholesky(A)
    >>> batched_cholesky_solve(L, torch.tensor([[[6.0, 2.0], [7.0, 2.0]]]))
    tensor([[[1.0000, 0.3750],
             [1.0000, 0.2500]]])
    """
    _check_solve_args(L, B)
    return torch.ops.attn_ext.batched_cholesky_solve(L, B)


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
    >>> from attn_ext.ops.intention import batched_spd_solve
    >>> A = torch.tensor([[[4.0, 2.0], [2.0, 5.0]]])
    >>> batched_spd_solve(A, torch.tensor([[[6.0, 2.0], [7.0, 2.0]]]))
    tensor([[[1.0000, 0.3750],
             [1.0000, 0.2500]]])
    """
    check_matrix_and_rhs(BATCHED_SPD_SOLVE, "A", A, B)
    X, info = functorch_entry(torch.ops.attn_ext.batched_spd_solve)(A, B)
    if check_errors and tracing():  # torch.compile: asserted when the compiled graph runs
        check_on_device(info == 0, "attn_ext.batched_spd_solve: A is not positive definite (a Cholesky pivot is "
                        "not positive and finite)")
    elif check_errors and info.numel() > 0:
        info = concrete(info)  # under vmap: the batched values (vmapped dimensions first)
        failed = torch.nonzero(info)
        if failed.numel() > 0:
            index = tuple(failed[0].tolist())
            raise ValueError(f"attn_ext.batched_spd_solve: A{list(index)} (of batch shape {tuple(A.shape[:-2])}) is "
                             f"not positive definite: the pivot of column {int(info[index]) - 1} is not positive "
                             "and finite")
    return X
