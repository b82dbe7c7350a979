"""Kernelised Intention (the Intention paper, §3.1 eq. 4), exact or with Nyström landmarks.

With features ``φ(X) = k(X, L) k(L, L)^{-1/2}`` of the keys and queries (``L`` = the keys, or ``m``
landmark keys), Intention runs on ``(φ(K), V, φ(Q))``:

    out = φ(Q) (φ(K)ᵀφ(K) + αI)⁻¹ φ(K)ᵀ V.

With ``L = K`` this is kernel ridge regression, ``k(Q, K) (k(K, K) + αI)⁻¹ V``; with ``m < N``
landmarks it is its Nyström approximation at cost ``O((N + M)·m·(D + m) + m³)`` instead of
``O(N³)``. The linear kernel with ``D`` landmarks that span the key space gives plain Intention back.
The features are built by :mod:`.kernel_features`, the regression is the fused Intention op; the
exact form without a jitter or a named backend is solved directly by :mod:`.kernel_ridge`, which
needs no jitter for ``α > 0`` where the feature path needs ``k(K, K)`` itself to be invertible.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from attn_ext.ops.intention import naive as reference
from attn_ext.ops.intention.kernel_features import KERNELS, landmark_features, select_landmarks
from attn_ext.ops.intention.kernel_ridge import kernel_ridge
from attn_ext.ops.intention.ridge import AlphaLike, _alpha_tensor, intention
from attn_ext.ops.intention.variant_checks import check_qkv, named, non_negative_float, per_head
from attn_ext.ops.utils.concrete import concrete, tracing
from attn_ext.ops.utils.dtypes import compute_dtype
from attn_ext.ops.utils.validation import is_int_scalar


def kernelised_intention(q: Tensor, k: Tensor, v: Tensor, *, alpha: AlphaLike = 1.0, kernel: str = "rbf",
                         lengthscale: Union[float, Tensor] = 1.0, num_landmarks: Optional[int] = None,
                         generator: Optional[torch.Generator] = None, jitter: float = 0.0,
                         key_padding_mask: Optional[Tensor] = None, scale: float = 1.0,
                         backend: Optional[str] = None) -> Tensor:
    """Intention on kernel features: ``scale·φ(Q) (φ(K)ᵀφ(K) + αI)⁻¹ φ(K)ᵀ V`` per batch and head.

    Parameters
    ----------
    q, k, v, key_padding_mask, scale, backend
        As in :func:`attn_ext.intention`. ``backend`` picks the fused kernel of the regression on the
        features (``m`` dimensions: N for the exact form). The exact form without ``jitter`` and
        without a ``backend`` is solved directly as kernel ridge regression (Cholesky of
        ``k(K, K) + αI`` in ``torch.linalg``), which needs no jitter for ``α > 0``.
    alpha : float or Tensor
        Ridge ``α >= 0`` on the features (a tensor broadcastable to ``[B, H]`` receives a gradient).
        ``α = 0`` interpolates the values (the noise-free kernel regression); it raises if the
        feature system is singular, as :func:`attn_ext.intention` does.
    kernel : {"rbf", "linear"}
        ``"rbf"``: ``exp(−‖x − y‖²/(2ℓ²))``, the paper's Gaussian kernel. ``"linear"``:
        ``(x/ℓ)·(y/ℓ)``; its ``k(L, L)`` has rank at most D, so it needs ``num_landmarks <= D``.
    lengthscale : float or Tensor
        ``ℓ > 0``; a tensor broadcastable to ``[B, H]`` (e.g. one per head) receives a gradient.
    num_landmarks : int, optional
        None: the exact form (every valid key is a landmark, ``m = N``). An int ``1 <= m <= N``: the
        Nyström form with ``m`` distinct valid keys per batch entry as landmarks, shared by the heads:
        evenly spaced over the valid keys in their order (key ``floor(j·n/m)`` of the ``n`` valid
        ones) without ``generator``, a uniformly random subset drawn from ``generator`` with one. A
        batch entry with fewer than ``m`` valid keys uses all of them. With ``m = N`` the Nyström
        form is the exact one.
    generator : torch.Generator, optional
        Draws the landmarks (only with ``num_landmarks``).
    jitter : float
        Added to the diagonal of ``k(L, L)`` before its Cholesky factorisation (default 0: the exact
        math). On the feature path (Nyström, a named ``backend``, or a jitter given) ``k(L, L)`` must
        be numerically positive definite (no Cholesky pivot below ``m·eps`` times its largest
        diagonal entry): close landmarks, many landmarks in few dimensions or a large lengthscale
        make it singular, and the call raises ``RuntimeError`` with the tolerance a jitter must
        exceed. The direct exact path only needs ``k(K, K) + αI`` to be, which holds for ``α > 0``;
        with ``α = 0`` it raises in the same cases.

    Returns
    -------
    Tensor
        ``[B, H, M, Dv]`` in the input dtype (computed in float32 for half inputs). A NaN/inf valid
        key or value makes its (batch, head) NaN, a NaN/inf query row its row; padding keys are
        never read.

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> q, k, v = (torch.randn(1, 2, n, 3, dtype=torch.float64) for n in (4, 30, 30))
    >>> exact = ae.kernelised_intention(q, k, v, alpha=0.1, lengthscale=2.0)
    >>> kqk = torch.exp(-torch.cdist(q, k) ** 2 / 8)                 # kernel ridge regression
    >>> kkk = torch.exp(-torch.cdist(k, k) ** 2 / 8)
    >>> ridge = kqk @ torch.linalg.solve(kkk + 0.1 * torch.eye(30, dtype=torch.float64), v)
    >>> bool(torch.allclose(exact, ridge))
    True
    >>> ae.kernelised_intention(q, k, v, alpha=0.1, lengthscale=2.0, num_landmarks=10).shape
    torch.Size([1, 2, 4, 3])
    """
    op = "kernelised_intention"
    scale = check_qkv(op, q, k, v, key_padding_mask, scale)
    if kernel not in KERNELS:
        raise ValueError(f"attn_ext.{op}: unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    N = k.shape[2]
    if num_landmarks is not None and not (is_int_scalar(num_landmarks) and 1 <= num_landmarks <= N):
        raise ValueError(f"attn_ext.{op}: num_landmarks must be None (exact) or an int in [1, N = {N}], "
                         f"got {num_landmarks!r}")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"attn_ext.{op}: generator must be a torch.Generator, got {type(generator).__name__}")
        if num_landmarks is None:
            raise ValueError(f"attn_ext.{op}: a generator draws Nyström landmarks; pass num_landmarks too")
    jitter = non_negative_float(op, "jitter", jitter)
    dtype = compute_dtype(q.dtype)
    ell = per_head(op, "lengthscale", lengthscale, q, positive=True)
    q_, k_, v_ = q.to(dtype), k.to(dtype), v.to(dtype)
    ell = ell.to(torch.promote_types(ell.dtype, dtype))
    if key_padding_mask is not None:  # padding keys are never read: zeroed, not multiplied (NaN·0 is NaN)
        pad = key_padding_mask[:, None, :, None]
        k_ = torch.where(pad, torch.zeros_like(k_), k_)
        v_ = torch.where(pad, torch.zeros_like(v_), v_)
    if N == 0 or (num_landmarks is None and jitter == 0.0 and backend is None):
        alpha_t = _alpha_tensor(alpha, q, op)
        if N == 0:  # no keys, no features to build: the regression on nothing answers 0 (NaN query rows NaN)
            zeros = q_.new_zeros(*q.shape[:3], v.shape[-1])
            return (zeros + reference.nan_unless_finite(q_, (-1,))[..., None]).to(q.dtype)
        alpha_t = alpha_t.to(torch.promote_types(alpha_t.dtype, dtype))
        return (scale * kernel_ridge(q_, k_, v_, alpha_t, key_padding_mask, kernel, ell, op)).to(q.dtype)
    landmarks, landmark_pad = select_landmarks(k_, key_padding_mask, None if num_landmarks is None
                                               else int(num_landmarks), generator)
    (phi_q, phi_k), nan = landmark_features((q_, k_), landmarks, landmark_pad, kernel, ell, jitter, op)
    phi_q, phi_k = phi_q.to(dtype), phi_k.to(dtype) + nan[..., None, None].to(dtype)
    mask = key_padding_mask
    # Under torch.compile whether any landmark is padded cannot be read: the unit keys are added anyway
    # (where no landmark is padded they are all padding themselves, so nothing changes).
    if tracing() or bool(concrete(landmark_pad).any()):
        # A padded landmark's feature is 0 for every key, which would leave its row of φ(K)ᵀφ(K) empty
        # (singular for α = 0). One extra key per landmark, with feature e_j on the padded ones and
        # value 0, puts 1 on that diagonal entry and nothing in φ(K)ᵀV: its weight solves to 0, and
        # φ(Q) is 0 there, so the output is unchanged (the dual form treats its padding alike).
        B, H, m = phi_k.shape[0], phi_k.shape[1], phi_k.shape[-1]
        unit = torch.diag_embed(landmark_pad.to(dtype))[:, None].expand(B, H, m, m)
        phi_k = torch.cat([phi_k, unit], dim=2)
        v_ = torch.cat([v_, v_.new_zeros(B, H, m, v_.shape[-1])], dim=2)
        padding = key_padding_mask if key_padding_mask is not None else landmark_pad.new_zeros(B, N)
        mask = torch.cat([padding, ~landmark_pad], dim=1)      # only the padded landmarks' unit keys count
    with named(op, "intention"):
        out = intention(phi_q, phi_k, v_, alpha=alpha, key_padding_mask=mask, scale=scale, backend=backend)
    return out.to(q.dtype)
