"""Triton batched Cholesky factorisation and triangular solves for Intention (docs/spec.md §4).

One program per matrix ``(b, h)``: ``A = G + αI`` (``D ≤ 128``) lives in one ``[BLOCK_D, BLOCK_D]``
fp32 register tile for the whole factorisation, so the matrix is read from memory once and ``L`` written
once. Every step works on the whole tile and picks row/column ``j`` with ``tl.where`` masks and a
reduction: Triton tiles cannot be indexed by a runtime scalar, and ``D`` masked tile operations per
step cost ``O(D³)`` arithmetic, the same order as the factorisation itself.

* factorisation, right-looking, column by column: pivot ``a_jj``, column ``l_j = a_{·j}/√a_jj``,
  rank-1 update of the trailing block ``A_{>j,>j} −= l_{>j} l_{>j}ᵀ``;
* ``W = A⁻¹ R = L⁻ᵀ L⁻¹ R``: forward substitution ``L Y = R`` then back substitution ``Lᵀ X = Y``, both
  column oriented (row ``j`` is solved, then eliminated from the rows still to come), on
  ``[BLOCK_D, BLOCK_C]`` chunks of the right-hand side so that register use does not grow with ``Dv``.
  ``L`` is split once into a unit lower triangle and its diagonal, so a step is one column of ``L``,
  one row of the right-hand side and a rank-1 update, with no per-step pivot.

Padding of the tile (rows/columns ``≥ D``) is the identity: its off-diagonal entries are 0 (the Gram
kernel never loads padded columns) and the loops stop at ``D``, so it never mixes with the real matrix;
its unit diagonal keeps the padded rows of a solve at the right-hand side's zeros.

The same kernel serves the forward (factorise ``G + αI``, solve for ``W = A⁻¹C``) and the backward
(reuse the saved ``L``, solve for ``dB = A⁻¹(scale·Qᵀ dY)`` and reduce ``dα = −Σ dB ⊙ W``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["cholesky_solve_batched"]


@triton.jit
def _cholesky_lower(a, offs, D):
    """Lower Cholesky factor of the symmetric tile ``a`` (strict upper triangle zeroed) and the info code.

    ``info`` is 0, or ``j + 1`` for the first column ``j`` whose pivot is not positive and finite (LAPACK's
    convention, as ``torch.linalg.cholesky_ex`` and csrc/cpu/intention.cpp); the factorisation goes on
    with a unit pivot so that no NaN appears, and the caller discards the result. The pivots are
    collected and judged once after the loop, which keeps the loop body short.
    """
    rows = offs[:, None]
    cols = offs[None, :]
    pivots = tl.full(offs.shape, 1.0, tl.float32)
    for j in range(D):
        is_j = offs == j
        col = tl.sum(tl.where(is_j[None, :], a, 0.0), axis=1)
        pivot = tl.sum(tl.where(is_j, col, 0.0), axis=0)
        pivots = tl.where(is_j, pivot, pivots)
        # NaN > 0 is false: a NaN pivot also gets the unit stand-in.
        l_col = col / tl.sqrt(tl.where(pivot > 0.0, pivot, 1.0))
        below = tl.where(offs > j, l_col, 0.0)
        # Only the trailing block (rows and columns > j) changes: `below` is 0 elsewhere. Above the
        # diagonal, column j gets junk that the final tl.where clears.
        a = tl.where(is_j[None, :], l_col[:, None], a - below[:, None] * below[None, :])
    good = (pivots > 0.0) & (pivots < float("inf"))
    # Padded columns kept their initial unit pivot, so they are never the first bad one.
    first_bad = tl.min(tl.where(good, D, offs), axis=0)
    info = tl.where(first_bad < D, first_bad + 1, 0)
    return tl.where(cols > rows, 0.0, a), info


@triton.jit
def _unit_lower(lower, offs):
    """``(N, d)`` with ``L = (I + N)·diag(d)``: ``N`` strictly lower triangular, ``d`` the diagonal of ``L``.

    With unit diagonals the substitutions below need no pivot per step; the divisions by ``d`` are done
    once per right-hand side instead.
    """
    diagonal = offs[:, None] == offs[None, :]
    diag_by_col = tl.sum(tl.where(diagonal, lower, 0.0), axis=0)
    diag_by_row = tl.sum(tl.where(diagonal, lower, 0.0), axis=1)
    strict = tl.where(offs[None, :] < offs[:, None], lower / diag_by_col[None, :], 0.0)
    return strict, diag_by_row


@triton.jit
def _forward_substitution(strict, rhs, offs, D):
    """``(I + N)⁻¹ rhs``: for each ``j``, row ``j`` is final and is eliminated from the rows below."""
    for j in range(D):
        is_j = offs == j
        n_col = tl.sum(tl.where(is_j[None, :], strict, 0.0), axis=1)
        solved = tl.sum(tl.where(is_j[:, None], rhs, 0.0), axis=0)
        rhs -= n_col[:, None] * solved[None, :]
    return rhs


@triton.jit
def _back_substitution(strict, rhs, offs, D):
    """``(I + N)⁻ᵀ rhs``: column ``j`` of ``Nᵀ`` is row ``j`` of ``N``, eliminated from the rows above."""
    for step in range(D):
        is_j = offs == D - 1 - step
        n_row = tl.sum(tl.where(is_j[:, None], strict, 0.0), axis=0)
        solved = tl.sum(tl.where(is_j[:, None], rhs, 0.0), axis=0)
        rhs -= n_row[:, None] * solved[None, :]
    return rhs


@triton.jit
def _cholesky_solve(strict, diag, rhs, offs, D):
    """``(L Lᵀ)⁻¹ rhs`` with ``L = (I + N)·diag(d)``: ``Lᵀ = diag(d)(I + N)ᵀ``."""
    rhs = _forward_substitution(strict, rhs, offs, D) / diag[:, None]
    return _back_substitution(strict, rhs / diag[:, None], offs, D)


@triton.jit
def _solve_kernel(
    FACTOR, RHS, ALPHA, INFO, WEIGHTS, DALPHA,
    D, DV,
    FACTORISE: tl.constexpr, GRAD_ALPHA: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # FACTOR [B·H, D, D] and RHS, WEIGHTS [B·H, D, DV] are contiguous fp32 buffers owned by the wrapper.
    bh = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, BLOCK_C)
    d_ok = offs < D
    square = d_ok[:, None] & d_ok[None, :]
    diagonal = offs[:, None] == offs[None, :]
    factor_ptrs = FACTOR + bh * D * D + offs[:, None] * D + offs[None, :]
    a = tl.load(factor_ptrs, mask=square, other=0.0)
    if FACTORISE:
        alpha = tl.load(ALPHA + bh)
        a = tl.where(diagonal & square, a + alpha, a)
    # The padded diagonal is 1: the padded block stays the identity through factorisation and solves.
    a = tl.where(diagonal & ~square, 1.0, a)
    if FACTORISE:
        a, info = _cholesky_lower(a, offs, D)
        tl.store(factor_ptrs, a, mask=square)
        tl.store(INFO + bh, info)
        # A failed factor may have a zero diagonal: solve with the identity instead, the caller raises.
        a = tl.where(info == 0, a, diagonal.to(tl.float32))
    strict, diag = _unit_lower(a, offs)

    dalpha = tl.zeros([BLOCK_C], tl.float32)
    rhs_base = RHS + bh * D * DV + offs[:, None] * DV
    for c0 in range(0, DV, BLOCK_C):
        cols = c0 + offs_c
        chunk_ok = d_ok[:, None] & (cols < DV)[None, :]
        rhs = tl.load(rhs_base + cols[None, :], mask=chunk_ok, other=0.0)
        rhs = _cholesky_solve(strict, diag, rhs, offs, D)
        tl.store(rhs_base + cols[None, :], rhs, mask=chunk_ok)
        if GRAD_ALPHA:
            w = tl.load(WEIGHTS + bh * D * DV + offs[:, None] * DV + cols[None, :], mask=chunk_ok, other=0.0)
            dalpha -= tl.sum(rhs * w, axis=0)
    if GRAD_ALPHA:
        tl.store(DALPHA + bh, tl.sum(dalpha, axis=0))


def _num_warps(block_d: int) -> int:
    # The factor tile is BLOCK_D² fp32 registers spread over the warps: keep it near 64 per thread.
    return max(2, min(16, block_d * block_d // (64 * 32)))


def cholesky_solve_batched(factor: torch.Tensor, rhs: torch.Tensor, *, alpha: torch.Tensor | None = None,
                           weights: torch.Tensor | None = None, block_c: int | None = None):
    """Factorise and/or solve ``B·H`` small SPD systems in place, one Triton program per matrix.

    Parameters
    ----------
    factor : torch.Tensor
        Contiguous fp32 ``[B, H, D, D]``, ``D ≤ 128``. With ``alpha`` it holds ``G`` on entry and the
        lower Cholesky factor ``L`` of ``G + αI`` on exit (strict upper triangle 0); without, it holds a
        factor ``L`` and is only read.
    rhs : torch.Tensor
        Contiguous fp32 ``[B, H, D, Dv]``, overwritten with ``(L Lᵀ)⁻¹ rhs``.
    alpha : torch.Tensor, optional
        Contiguous fp32 ``[B, H]``: factorise ``factor + αI`` first (forward).
    weights : torch.Tensor, optional
        Contiguous fp32 ``[B, H, D, Dv]`` ``W``: also return ``−Σ rhs_out ⊙ W`` per matrix (backward's dα).
    block_c : int, optional
        Columns of ``rhs`` per substitution chunk (a power of two ≥ 16); all of them by default.

    Returns
    -------
    info : torch.Tensor or None
        int32 ``[B, H]`` when factorising: 0, or ``j + 1`` where the pivot of column ``j`` was not
        positive and finite (the outputs of that matrix are then meaningless).
    dalpha : torch.Tensor or None
        fp32 ``[B, H]`` when ``weights`` is given.
    """
    B, H, D, DV = rhs.shape
    device = rhs.device
    factorise = alpha is not None
    grad_alpha = weights is not None
    info = torch.zeros((B, H), dtype=torch.int32, device=device) if factorise else None
    dalpha = torch.empty((B, H), dtype=torch.float32, device=device) if grad_alpha else None
    if B * H == 0:
        return info, dalpha
    block_d = max(16, triton.next_power_of_2(D))
    block_c = block_c or max(16, triton.next_power_of_2(max(DV, 1)))
    # Never dereferenced when the matching flag is off (constexpr): any fp32 buffer will do.
    _solve_kernel[(B * H,)](
        factor, rhs, alpha if factorise else rhs, info if factorise else rhs, weights if grad_alpha else rhs,
        dalpha if grad_alpha else rhs, D, DV,
        FACTORISE=factorise, GRAD_ALPHA=grad_alpha, BLOCK_D=block_d, BLOCK_C=block_c,
        num_warps=_num_warps(block_d))
    return info, dalpha
