"""Batched Cholesky factorisation and solves of small SPD matrices (SPEC §4).

The Intention op ``Q (KᵀK + αI)⁻¹ KᵀV`` factors one D×D matrix per batch and head and solves with it
in the forward pass and once more in the backward pass; these two ops do that for a whole batch at
once. The C++ kernels (csrc/cpu/batched_cholesky.cpp, schemas in csrc/ops.cpp) get here

* fake (meta) kernels, for meta tensors and ``torch.compile``;
* an autograd formula that raises: the ops are not differentiable on purpose (the Intention
  backward differentiates through the factor by hand, with one more solve with the saved L). Without
  any formula torch would only warn and let gradients silently stop at these ops.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from attn_ext._extension import extension_error

__all__ = ["batched_cholesky", "batched_cholesky_solve"]

_SUPPORTED_DTYPES = (torch.float32, torch.float64)


def _check_square(op: str, name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"attn_ext.{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() < 2 or t.shape[-1] != t.shape[-2]:
        raise ValueError(f"attn_ext.{op}: {name} must be a batch of square matrices [..., n, n], "
                         f"got shape {tuple(t.shape)}")


def _check_dtype_and_device(op: str, name: str, t: Tensor) -> None:
    # Half precision is refused rather than upcast: a factor of a half-precision Gram matrix is too
    # inexact to return, and the Intention op forms KᵀK in fp32 anyway.
    if t.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"attn_ext.{op}: {name} must be float32 or float64, got {t.dtype} "
                        "(convert with .float(); a half-precision factor would be too inexact)")
    if t.device.type not in ("cpu", "meta") and not _has_kernel(op, t.device.type):
        raise RuntimeError(f"attn_ext.{op}: this build has kernels for CPU tensors"
                           + (" and CUDA tensors" if _has_kernel(op, "cuda") else "") + f", got {name} on {t.device}")


def _has_kernel(op: str, device_type: str) -> bool:
    """Whether ``attn_ext::op`` has a kernel for ``device_type`` in this build (CUDA ones need a CUDA torch)."""
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    return key is not None and extension_error() is None and torch._C._dispatch_has_kernel_for_dispatch_key(
        f"attn_ext::{op}", key)


def _check_matrix_and_rhs(op: str, matrix_name: str, matrix: Tensor, B: Tensor) -> None:
    """``matrix [..., n, n]`` and right-hand sides ``B [..., n, r]``: same batch dims, dtype and device."""
    _check_square(op, matrix_name, matrix)
    if not isinstance(B, Tensor):
        raise TypeError(f"attn_ext.{op}: B must be a torch.Tensor, got {type(B).__name__}")
    if B.dim() != matrix.dim() or B.shape[:-2] != matrix.shape[:-2]:
        raise ValueError(f"attn_ext.{op}: B must be [..., n, r] with the batch dimensions of {matrix_name} "
                         f"(no broadcasting); got {matrix_name} {tuple(matrix.shape)} and B {tuple(B.shape)}")
    if B.shape[-2] != matrix.shape[-1]:
        raise ValueError(f"attn_ext.{op}: {matrix_name} {tuple(matrix.shape)} is n×n with n = {matrix.shape[-1]} "
                         f"but B {tuple(B.shape)} has {B.shape[-2]} rows")
    _check_dtype_and_device(op, matrix_name, matrix)
    _check_dtype_and_device(op, "B", B)
    if matrix.dtype != B.dtype:
        raise TypeError(f"attn_ext.{op}: {matrix_name} and B must share a dtype, got {matrix.dtype} and {B.dtype}")
    if matrix.device != B.device:
        raise RuntimeError(f"attn_ext.{op}: {matrix_name} and B must be on one device, got {matrix.device} "
                           f"and {B.device}")


def _check_solve_args(L: Tensor, B: Tensor) -> None:
    _check_matrix_and_rhs("batched_cholesky_solve", "L", L, B)


def _require_extension() -> None:
    error = extension_error()
    if error is not None:
        raise RuntimeError(f"attn_ext: the batched Cholesky ops need the compiled kernels: {error}")


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
    >>> from attn_ext.ridge import batched_cholesky
    >>> A = torch.tensor([[[4.0, 2.0], [2.0, 5.0]], [[1.0, 2.0], [2.0, 1.0]]])
    >>> L, info = batched_cholesky(A)
    >>> L[0]
    tensor([[2., 0.],
            [1., 2.]])
    >>> info  # the second matrix is indefinite: its pivot at column 1 is 1 - 2² < 0
    tensor([0, 2], dtype=torch.int32)
    """
    _check_square("batched_cholesky", "A", A)
    _check_dtype_and_device("batched_cholesky", "A", A)
    _require_extension()
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
    >>> from attn_ext.ridge import batched_cholesky, batched_cholesky_solve
    >>> A = torch.tensor([[[4.0, 2.0], [2.0, 5.0]]])
    >>> L, info = batched_cholesky(A)
    >>> batched_cholesky_solve(L, torch.tensor([[[6.0, 2.0], [7.0, 2.0]]]))
    tensor([[[1.0000, 0.3750],
             [1.0000, 0.2500]]])
    """
    _check_solve_args(L, B)
    _require_extension()
    return torch.ops.attn_ext.batched_cholesky_solve(L, B)


def _fake_cholesky(A: Tensor) -> Tuple[Tensor, Tensor]:
    _check_square("batched_cholesky", "A", A)
    return A.new_empty(A.shape), A.new_empty(A.shape[:-2], dtype=torch.int32)


def _fake_cholesky_solve(L: Tensor, B: Tensor) -> Tensor:
    _check_solve_args(L, B)
    return B.new_empty(B.shape)


def _not_differentiable(op: str):
    def backward(ctx, *grads):
        raise RuntimeError(f"attn_ext.{op} is not differentiable (by design: the Intention op's backward will "
                           "reuse the factor by hand); use torch.linalg.cholesky / torch.cholesky_solve where "
                           "gradients are needed")

    return backward


if extension_error() is None:
    torch.library.register_fake("attn_ext::batched_cholesky")(_fake_cholesky)
    torch.library.register_fake("attn_ext::batched_cholesky_solve")(_fake_cholesky_solve)
    for _op in ("batched_cholesky", "batched_cholesky_solve"):
        torch.library.register_autograd(f"attn_ext::{_op}", _not_differentiable(_op))
