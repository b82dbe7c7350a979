"""Argument checks of the batched Cholesky ops (``batched_cholesky``, ``batched_cholesky_solve``,
``batched_spd_solve``), shared by their public functions (:mod:`.cholesky`) and their fake kernels
(:mod:`.registration`), so that meta tensors and torch.compile raise the errors eager calls do."""
from __future__ import annotations

import torch
from torch import Tensor

from attn_ext.ops.utils import dispatch

_SUPPORTED_DTYPES = (torch.float32, torch.float64)


def check_square(op: str, name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"attn_ext.{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() < 2 or t.shape[-1] != t.shape[-2]:
        raise ValueError(f"attn_ext.{op}: {name} must be a batch of square matrices [..., n, n], "
                         f"got shape {tuple(t.shape)}")


def check_dtype_and_device(op: str, name: str, t: Tensor) -> None:
    # Half precision is refused rather than upcast: a factor of a half-precision Gram matrix is too
    # inexact to return, and the Intention op forms KᵀK in fp32 anyway.
    if t.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"attn_ext.{op}: {name} must be float32 or float64, got {t.dtype} "
                        "(convert with .float(); a half-precision factor would be too inexact)")
    if t.device.type != "meta":
        dispatch.select_backend(op, None, t)  # compiled kernels only: raises with each backend's reason


def check_matrix_and_rhs(op: str, matrix_name: str, matrix: Tensor, B: Tensor) -> None:
    """``matrix [..., n, n]`` and right-hand sides ``B [..., n, r]``: same batch dims, dtype and device."""
    check_square(op, matrix_name, matrix)
    if not isinstance(B, Tensor):
        raise TypeError(f"attn_ext.{op}: B must be a torch.Tensor, got {type(B).__name__}")
    if B.dim() != matrix.dim() or B.shape[:-2] != matrix.shape[:-2]:
        raise ValueError(f"attn_ext.{op}: B must be [..., n, r] with the batch dimensions of {matrix_name} "
                         f"(no broadcasting); got {matrix_name} {tuple(matrix.shape)} and B {tuple(B.shape)}")
    if B.shape[-2] != matrix.shape[-1]:
        raise ValueError(f"attn_ext.{op}: {matrix_name} {tuple(matrix.shape)} is n×n with n = {matrix.shape[-1]} "
                         f"but B {tuple(B.shape)} has {B.shape[-2]} rows")
    check_dtype_and_device(op, matrix_name, matrix)
    check_dtype_and_device(op, "B", B)
    if matrix.dtype != B.dtype:
        raise TypeError(f"attn_ext.{op}: {matrix_name} and B must share a dtype, got {matrix.dtype} and {B.dtype}")
    if matrix.device != B.device:
        raise RuntimeError(f"attn_ext.{op}: {matrix_name} and B must be on one device, got {matrix.device} "
                           f"and {B.device}")
