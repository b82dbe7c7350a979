"""The variance-preserving output scale of Intention derived in the appendix of the Intention paper.

Reading of the paper (Garnelo & Czarnecki, appendix "Normalisation", referred to from §3.1): with
standard-normal queries and keys, the Intention map ``Q Kᵀ(KKᵀ)⁻¹`` (N keys in D dimensions,
N < D) has entries of variance ``1/(D − N − 1)`` — the mean of the inverse Wishart matrix
``(KKᵀ)⁻¹`` — so it vanishes as D grows (for a single key, ``q·k/‖k‖²`` with ``‖k‖² ≈ D``). The
paper's cure is to multiply the whole computation by ``√D`` (where attention divides its scores by
``√D``), which makes the variance ``D/(D − N − 1) → 1``. It is not a normalisation of the
statistics by N: dividing ``KᵀK`` and ``KᵀV`` by N would only turn ``α`` into ``N·α``.

For the convex regulariser ``σ(θ)KᵀK + (1 − σ(θ))I`` (:func:`attn_ext.convex_intention`) the paper
uses ``0.5·√D``: at its initialisation ``θ = 0`` the system is ``½(KᵀK + I)``, whose inverse doubles
the output, and the ½ undoes that, so that the scaled convex form starts as ``√D`` times ridge
Intention with ``α = 1``.

Both are passed as ``scale`` (which multiplies the queries, the same as multiplying the output).
"""
from __future__ import annotations

import math

from attn_ext.ops.utils.validation import is_int_scalar


def intention_variance_scale(head_dim: int, *, convex: bool = False) -> float:
    """The paper's output scale: ``√D`` for Intention, ``0.5·√D`` for its convex-regulariser form.

    Parameters
    ----------
    head_dim : int
        ``D``, the key/query dimension of one head (positive).
    convex : bool
        The scale of :func:`attn_ext.convex_intention` (``0.5·√D``) rather than of
        :func:`attn_ext.intention` / :func:`attn_ext.pinv_intention` (``√D``).

    Examples
    --------
    >>> import attn_ext as ae
    >>> ae.intention_variance_scale(64), ae.intention_variance_scale(64, convex=True)
    (8.0, 4.0)
    """
    if not (is_int_scalar(head_dim) and head_dim > 0):
        raise ValueError(f"attn_ext.intention_variance_scale: head_dim must be a positive int, got {head_dim!r}")
    if not isinstance(convex, bool):
        raise TypeError(f"attn_ext.intention_variance_scale: convex must be a bool, got {convex!r}")
    root = math.sqrt(int(head_dim))
    return 0.5 * root if convex else root
