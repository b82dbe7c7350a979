"""Kernel features of kernelised Intention: ``φ(X) = k(X, L) F`` with ``F Fᵀ = k(L, L)⁻¹``, and landmark choice.

The paper (Garnelo & Czarnecki, §3.1, eq. 4) writes ``φ(X) = k(X, K) k(K, K)^{-1/2}``; the Nyström
method replaces the keys ``K`` by ``m`` landmark keys ``L``. Intention on such features depends on
them only through their inner products ``φ(X)φ(Y)ᵀ = k(X, L) k(L, L)⁻¹ k(L, Y)`` (by the push-through
identity, and for ``α = 0`` because the least-squares fit is invariant to an invertible change of
features), so any ``F`` with ``F Fᵀ = k(L, L)⁻¹`` gives the same output. We use the inverse transpose of
the Cholesky factor, ``F = C⁻ᵀ`` with ``k(L, L) = C Cᵀ``: a triangular solve, where the symmetric
inverse square root needs an eigendecomposition whose gradient breaks down at repeated eigenvalues.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from attn_ext.ops.intention import naive as reference
from attn_ext.ops.utils.concrete import check_on_device, concrete, tracing

KERNELS = ("rbf", "linear")


def kernel_matrix(x: Tensor, y: Tensor, kernel: str, lengthscale: Tensor) -> Tensor:
    """``k(x_i, y_j)`` for ``x [B, H, Mx, D]``, ``y [B, H, My, D]``, ``lengthscale [B, H]``.

    ``rbf``: ``exp(−‖x − y‖² / (2ℓ²))`` (the paper's Gaussian kernel ``exp(γ‖x − y‖²)`` with
    ``γ = −1/(2ℓ²)``); ``linear``: ``(x/ℓ)·(y/ℓ)``.
    """
    x = x / lengthscale[..., None, None]
    y = y / lengthscale[..., None, None]
    inner = x @ y.transpose(-1, -2)
    if kernel == "linear":
        return inner
    # ‖x‖² + ‖y‖² − 2x·y, clamped at 0 against rounding: no [Mx, My, D] difference tensor.
    squared = (x * x).sum(-1)[..., :, None] + (y * y).sum(-1)[..., None, :] - 2.0 * inner
    return torch.exp(-0.5 * squared.clamp_min(0.0))


def select_landmarks(k: Tensor, key_padding_mask: Optional[Tensor], num_landmarks: Optional[int],
                     generator: Optional[torch.Generator]) -> Tuple[Tensor, Tensor]:
    """``(landmarks [B, H, m, D], landmark_pad [B, m])``: which keys the features are built on.

    ``num_landmarks`` None: every key (the exact form; padding keys are padded landmarks). Otherwise
    ``m`` distinct valid keys per batch entry, the same for every head: evenly spaced over the valid
    keys in their order (``floor(j·n/m)``, j < m, of the n valid ones) without a generator, a uniformly
    random subset drawn from ``generator`` with one. An entry with ``n < m`` valid keys takes them all
    and pads the remaining landmarks.
    """
    B, H, N, D = k.shape
    if num_landmarks is None:
        pad = torch.zeros(B, N, dtype=torch.bool, device=k.device) if key_padding_mask is None else key_padding_mask
        return k, pad
    m = num_landmarks
    padding = torch.zeros(B, N, dtype=torch.bool, device=k.device) if key_padding_mask is None else key_padding_mask
    valid = (~padding).sum(dim=1, keepdim=True)                                   # [B, 1]
    slot = torch.arange(m, device=k.device)[None, :]                              # [1, m]
    if generator is None:
        order = torch.argsort(padding.to(torch.int8), dim=1, stable=True)         # valid keys first, in order
        position = torch.where(valid >= m, torch.div(slot * valid, m, rounding_mode="floor"), slot)
    else:
        scores = torch.rand(B, N, generator=generator, device=generator.device, dtype=torch.float64).to(k.device)
        order = torch.argsort(scores.masked_fill(padding, 2.0), dim=1)             # a random order, valid first
        position = slot.expand(B, m)
    index = order.gather(1, position.clamp_max(N - 1))                            # [B, m]
    landmarks = k.gather(2, index[:, None, :, None].expand(B, H, m, D))
    return landmarks, slot >= valid


def landmark_features(xs: Tuple[Tensor, ...], landmarks: Tensor, landmark_pad: Tensor, kernel: str,
                      lengthscale: Tensor, jitter: float, op: str) -> Tuple[Tuple[Tensor, ...], Tensor]:
    """The features ``φ(x) = k(x, L) C⁻ᵀ`` of each ``x [B, H, *, D]`` in ``xs``, and ``nan [B, H]``.

    A padded landmark contributes a zero feature (its column of ``k(x, L)`` is set to 0 and its row
    and column of ``k(L, L)`` to the identity's). ``nan`` is NaN for the heads whose ``k(L, L)`` is not
    finite (a NaN/inf landmark key): the caller makes them NaN. Any other ``k(L, L) + jitter·I`` that
    is not positive definite raises ``RuntimeError`` naming ``op``, the head and the remedies.
    """
    pad = landmark_pad[:, None, :]                                                # [B, 1, m]
    # Padded landmarks are zeroed before any product: a NaN there times a zero weight would be NaN,
    # in the values and in the gradients.
    landmarks = torch.where(pad[..., None], torch.zeros_like(landmarks), landmarks)
    gram = kernel_matrix(landmarks, landmarks, kernel, lengthscale)
    m = gram.shape[-1]
    eye = torch.eye(m, dtype=gram.dtype, device=gram.device)
    gram = torch.where(pad[..., :, None] | pad[..., None, :], eye, gram)
    nan = reference.nan_unless_finite(gram, (-2, -1))
    nonfinite = torch.isnan(nan)
    system = torch.where(nonfinite[..., None, None], eye, gram + jitter * eye)
    factor, info = torch.linalg.cholesky_ex(system)
    _check_factorised(op, tiny_pivots_as_failures(factor, system, info), nonfinite, kernel, jitter,
                      m * torch.finfo(system.dtype).eps)
    features = []
    for x in xs:
        cross = kernel_matrix(x, landmarks, kernel, lengthscale).masked_fill(pad[:, :, None, :], 0.0)
        # φ(x)ᵀ = C⁻¹ k(L, x): one triangular solve for all rows of x.
        solved = torch.linalg.solve_triangular(factor, cross.transpose(-1, -2), upper=False)
        features.append(solved.transpose(-1, -2))
    return tuple(features), nan


def tiny_pivots_as_failures(factor: Tensor, system: Tensor, info: Tensor) -> Tensor:
    """``info``, also failing a factorisation whose pivot ``C_jj²`` is below ``m·eps·max_i A_ii``.

    An exactly singular kernel matrix (a duplicated landmark) often factorises with a pivot of
    rounding size instead of failing; the features would then carry errors of order 1/pivot², so it
    is refused like a failed factorisation (a rank tolerance, as :func:`torch.linalg.pinv` uses).
    """
    m = system.shape[-1]
    if m == 0:                      # no keys (or landmarks): nothing to factorise
        return info
    pivots = factor.diagonal(dim1=-2, dim2=-1) ** 2
    largest = system.diagonal(dim1=-2, dim2=-1).amax(-1, keepdim=True)
    tiny = pivots < m * torch.finfo(system.dtype).eps * largest
    first = torch.argmax(tiny.to(torch.int8), dim=-1).to(info.dtype) + 1
    return torch.where((info == 0) & tiny.any(-1), first, info)


def first_failure(info: Tensor, nonfinite: Tensor) -> Optional[Tuple[Tuple[int, int], int]]:
    """``((batch, head), column)`` of the first failed factorisation that is not a non-finite head, or None.

    ``info`` is :func:`torch.linalg.cholesky_ex`'s (after :func:`tiny_pivots_as_failures`); under
    ``torch.func`` its values are read through the wrappers (the vmapped dimensions lead).
    """
    if info.device.type == "meta" or tracing():  # torch.compile: the callers assert it in the graph instead
        return None
    info = concrete(info)
    failed = (info != 0) & ~concrete(nonfinite)
    if not bool(failed.any()):
        return None
    index = tuple(failed.nonzero()[0].tolist())
    return (index[-2], index[-1]), int(info[index]) - 1


def check_factorised_in_graph(info: Tensor, nonfinite: Tensor, message: str) -> None:
    """Under ``torch.compile``: assert, when the graph runs, that every finite head factorised (``message``
    names the op and the remedies; the failing head cannot be named there)."""
    if tracing():
        check_on_device((info == 0) | nonfinite, message)


def _check_factorised(op: str, info: Tensor, nonfinite: Tensor, kernel: str, jitter: float, tolerance: float) -> None:
    check_factorised_in_graph(info, nonfinite, f"attn_ext.{op}: the landmark kernel matrix k(L, L) + jitter·I is not "
                              "positive definite: pass a jitter above its pivot tolerance, or use fewer landmarks "
                              "(num_landmarks)")
    failed = first_failure(info, nonfinite)
    if failed is None:
        return
    (b, h), column = failed
    hint = ("the linear kernel's k(L, L) = LLᵀ has rank at most D: use at most D landmarks (num_landmarks <= D), "
            "linearly independent" if kernel == "linear" else
            "duplicated (or nearly equal) landmark keys, or so many landmarks, or a lengthscale so large, that "
            "the kernel matrix is numerically singular (the exact form with many keys in few dimensions is the "
            "usual case)")
    raise RuntimeError(
        f"attn_ext.{op}: the landmark kernel matrix k(L, L) + jitter·I (jitter = {jitter:g}) is not positive "
        f"definite at [batch, head] = [{b}, {h}] (Cholesky pivot of column {column}): "
        f"{hint}. Pass a jitter above the pivot tolerance m·eps·max k(L, L)_ii ({tolerance:.1e} times the "
        "kernel's diagonal, which is 1 for rbf), or use fewer landmarks (num_landmarks)")
