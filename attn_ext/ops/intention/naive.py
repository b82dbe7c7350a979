"""Readable PyTorch reference of Intention and σIntention (docs/spec.md §4).

Everything is batched over ``[B, H]``; the kernels (csrc/cpu/intention*.cpp, the Triton kernels of this folder) are
tested against these functions, and these against an independent least-squares solve in the tests.

Notation: ``K [N, D]``, ``V [N, Dv]``, ``Q [M, D]`` per (batch, head); masked keys are dropped, which
is the same as zeroing their rows of ``K`` and ``V``.

* statistics ``G = KᵀK`` (``[D, D]``) and ``C = KᵀV`` (``[D, Dv]``), additive over key chunks;
* primal form ``out = scale·Q (G + αI)⁻¹ C`` (a D×D solve);
* dual form ``out = scale·Q Kᵀ (KKᵀ + αI)⁻¹ V`` (an N×N solve), equal for α > 0 by the push-through
  identity ``(KᵀK + αI)⁻¹Kᵀ = Kᵀ(KKᵀ + αI)⁻¹``;
* σIntention ``softmax(scale·Q (G + αI)⁻¹ Kᵀ) V``, an ordinary softmax attention of the transformed
  queries ``Q̃ = scale·Q (G + αI)⁻¹`` with score scale 1.

Singular systems and non-finite inputs (docs/intention.md), the same on every backend and form:

* a head whose statistics are not finite (a NaN/inf valid key or value) gets an all-NaN output;
  a non-finite query row gets a NaN row; padding keys are never read, so they never matter;
* otherwise ``G + αI`` must be positive definite: α = 0 with fewer than D valid keys, or a failed
  Cholesky factorisation, raises :class:`RuntimeError` (:func:`singular_error`).
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from attn_ext.ops.utils.concrete import check_on_device, concrete, tracing

Dims = Union[int, Tuple[int, ...]]


def masked_keys(k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """``k``, ``v`` with the rows of padding keys zeroed (``key_padding_mask [B, N]``, True = padding).

    ``torch.where``, not a product with the mask: a NaN padding key times 0 would still be NaN.
    """
    if key_padding_mask is None:
        return k, v
    pad = key_padding_mask[:, None, :, None]
    return torch.where(pad, torch.zeros_like(k), k), torch.where(pad, torch.zeros_like(v), v)


def valid_key_count(k: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
    """Valid keys per batch entry, ``[B, 1]`` (broadcasts against ``[B, H]``)."""
    if key_padding_mask is None:
        return torch.full((k.shape[0], 1), k.shape[2], dtype=torch.long, device=k.device)
    return (~key_padding_mask).sum(dim=1, keepdim=True)


def nan_unless_finite(x: Tensor, dims: Dims) -> Tensor:
    """0 where ``x`` is finite over ``dims`` (reduced), NaN where it holds a NaN or ±inf.

    Added to a result, it makes that result NaN exactly where an input it depends on is not finite,
    and its gradient (``2·t·0`` for the value ``t``) is NaN there too, so that the backward of a NaN
    output gives NaN gradients rather than the silent zeros of a ``masked_fill``.
    """
    t = (x * 0).sum(dim=dims)
    return t * t


def statistics(k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(G = KᵀK [B, H, D, D], C = KᵀV [B, H, D, Dv])`` over the valid keys, in the input dtype."""
    k, v = masked_keys(k, v, key_padding_mask)
    kt = k.transpose(-1, -2)
    return kt @ k, kt @ v


def regularised(gram: Tensor, alpha: Tensor) -> Tensor:
    """``G + αI`` with ``alpha`` broadcast per ``[B, H]``."""
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    return gram + alpha[..., None, None] * eye


def singular_error(op: str, where: Tuple[int, int], D: int, *, valid_keys: int, alpha: float,
                   column: Optional[int] = None) -> RuntimeError:
    """The error of a singular system at ``[batch, head] = where`` (the C++ kernels raise the same text).

    ``column``: where the Cholesky pivot was not positive; None for α = 0 with fewer than D valid keys.
    """
    if column is None:
        why = f"alpha = 0 with {valid_keys} valid keys for head dim D = {D} (KᵀK has rank at most {valid_keys})"
    else:
        why = (f"the Cholesky pivot of column {column} of {D} is not positive (alpha = {alpha:g}, "
               f"{valid_keys} valid keys)")
    return RuntimeError(
        f"attn_ext.{op}: KᵀK + αI is singular at [batch, head] = [{where[0]}, {where[1]}]: {why}. alpha = 0 needs "
        "KᵀK invertible, i.e. at least D valid keys (N >= D) of full rank D (no collinear keys); use alpha > 0 "
        "(ridge) for fewer or collinear keys")


def check_solvable(op: str, info: Tensor, alpha: Tensor, valid_keys: Tensor, nonfinite: Tensor, D: int) -> None:
    """Raises :func:`singular_error` for the first head ``[B, H]`` with finite statistics whose system is
    singular: α = 0 with fewer than D valid keys (singular whatever rounding lets the factorisation do),
    or a Cholesky ``info`` that is not 0. Heads in ``nonfinite`` give NaN instead. One host sync."""
    if info.device.type == "meta":
        return
    if tracing():  # torch.compile: the same rule, asserted when the compiled graph runs
        failed = (((alpha == 0) & (valid_keys < D)) | (info != 0)) & ~nonfinite
        check_on_device(~failed, f"attn_ext.{op}: KᵀK + αI is singular (alpha = 0 with fewer than D = {D} valid "
                        "keys, or a Cholesky pivot that is not positive); use alpha > 0 (ridge) for fewer or "
                        "collinear keys")
        return
    # concrete(): under torch.func.vmap the check reads the wrapped values (leading vmapped dimensions).
    info, alpha, nonfinite, valid = (concrete(t) for t in (info, alpha, nonfinite, valid_keys))
    shape = torch.broadcast_shapes(info.shape, alpha.shape, nonfinite.shape, valid.shape)
    info, alpha, nonfinite, valid = (t.expand(shape) for t in (info, alpha, nonfinite, valid))
    too_few = (alpha == 0) & (valid < D) & ~nonfinite
    failed = (too_few | (info != 0)) & ~nonfinite
    if not bool(failed.any()):
        return
    index = tuple(failed.nonzero()[0].tolist())
    column = None if bool(too_few[index]) else int(info[index]) - 1
    raise singular_error(op, index[-2:], D, valid_keys=int(valid[index]), alpha=float(alpha[index]), column=column)


def solve_regularised(gram: Tensor, alpha: Tensor, rhs: Tensor, *, valid_keys: Tensor, nan: Optional[Tensor] = None,
                      op: str = "intention") -> Tensor:
    """``(G + αI)⁻¹ rhs`` by Cholesky, per ``[B, H]``.

    ``nan`` (``[B, H]``, from :func:`nan_unless_finite`; by default that of ``G``) marks the heads
    whose statistics are not finite: their result is NaN. The others must be positive definite
    (:func:`check_solvable`); ``valid_keys`` broadcasts to ``[B, H]``.
    """
    nan = nan_unless_finite(gram, (-2, -1)) if nan is None else nan
    nonfinite = torch.isnan(nan)
    # A non-finite head is factorised as the identity, so that it neither fails nor raises: its
    # result is made NaN by `nan` anyway.
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    system = torch.where(nonfinite[..., None, None], eye, regularised(gram, alpha))
    factor, info = torch.linalg.cholesky_ex(system)
    check_solvable(op, info, alpha, valid_keys, nonfinite, gram.shape[-1])
    # α·nan is NaN exactly where nan is (α is finite) and carries α's gradient: NaN there too.
    return torch.cholesky_solve(rhs, factor) + (alpha * nan)[..., None, None]


def intention_primal(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, key_padding_mask: Optional[Tensor] = None,
                     scale: float = 1.0) -> Tensor:
    """``scale·Q (KᵀK + αI)⁻¹ KᵀV``, ``alpha [B, H]``: a D×D Cholesky solve."""
    gram, cross = statistics(k, v, key_padding_mask)
    nan = nan_unless_finite(gram, (-2, -1)) + nan_unless_finite(cross, (-2, -1))
    weights = solve_regularised(gram, alpha, cross, valid_keys=valid_key_count(k, key_padding_mask), nan=nan)
    return scale * (q @ weights) + nan_unless_finite(q, -1)[..., None]


def intention_dual(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, key_padding_mask: Optional[Tensor] = None,
                   scale: float = 1.0) -> Tensor:
    """``scale·Q Kᵀ (KKᵀ + αI)⁻¹ V``; padding keys get a unit diagonal so that their zero rows stay out.

    The push-through identity that makes this the primal answer needs α > 0: with α = 0 it would give
    the minimum-norm interpolant where KᵀK is singular (N < D), and fail where KKᵀ is (N > D). So any
    α = 0 is answered by the primal system, which raises where KᵀK is singular.
    """
    # (Under torch.compile the values cannot be read: attn_ext.intention passes such heads a stand-in.)
    if alpha.device.type != "meta" and not tracing() and bool((concrete(alpha) == 0).any()):
        return intention_primal(q, k, v, alpha, key_padding_mask, scale)
    k, v = masked_keys(k, v, key_padding_mask)
    kernel = k @ k.transpose(-1, -2)
    nan = nan_unless_finite(kernel, (-2, -1)) + nan_unless_finite(v, (-2, -1))
    diag = alpha[..., None].expand(*alpha.shape, k.shape[-2])
    if key_padding_mask is not None:
        # A padding key's row and column of KKᵀ are 0 and its value row is 0; any positive diagonal
        # keeps the system regular without changing the solution (its coefficient solves to 0).
        diag = torch.where(key_padding_mask[:, None, :], torch.ones_like(diag), diag)
    system = kernel + torch.diag_embed(diag)
    # α > 0 here, so the N×N system is positive definite: every key counts as valid for the check.
    all_keys = torch.full_like(alpha, k.shape[-2], dtype=torch.long)
    coefficients = solve_regularised(system, torch.zeros_like(alpha), v, valid_keys=all_keys, nan=nan)
    # α·nan: α's gradient is NaN on the non-finite heads too (α enters this system through its diagonal).
    coefficients = coefficients + (alpha * nan)[..., None, None]
    return scale * ((q @ k.transpose(-1, -2)) @ coefficients) + nan_unless_finite(q, -1)[..., None]


def transformed_queries(q: Tensor, k: Tensor, alpha: Tensor, key_padding_mask: Optional[Tensor] = None,
                        scale: float = 1.0, op: str = "sigma_intention") -> Tensor:
    """``Q̃ = scale·Q (KᵀK + αI)⁻¹`` (``A`` is symmetric, so ``Q̃ = scale·(A⁻¹Qᵀ)ᵀ``); NaN rows for
    non-finite query rows, all NaN where the keys are not finite."""
    gram, _ = statistics(k, k[..., :0], key_padding_mask)
    solved = solve_regularised(gram, alpha, q.transpose(-1, -2), valid_keys=valid_key_count(k, key_padding_mask),
                               op=op)
    return scale * solved.transpose(-1, -2) + nan_unless_finite(q, -1)[..., None]


def sigma_intention(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, key_padding_mask: Optional[Tensor] = None,
                    scale: float = 1.0) -> Tensor:
    """``softmax(Q̃ Kᵀ) V`` over the valid keys; a row without valid keys gives 0."""
    q_tilde = transformed_queries(q, k, alpha, key_padding_mask, scale)
    k, v = masked_keys(k, v, key_padding_mask)
    scores = q_tilde @ k.transpose(-1, -2)
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        empty = key_padding_mask.all(dim=-1)[:, None, None, None]
        scores = scores.masked_fill(empty, 0.0)
    weights = torch.softmax(scores, dim=-1)
    if key_padding_mask is not None:
        weights = weights.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    return weights @ v
