"""The positional rules and score modifications of the attention Triton kernels: a band of keys about each query's
diagonal (a sliding window, the causal rule off the top-left diagonal), the soft cap ``s = c·tanh(s / c)`` and
ALiBi's bias ``−slope·|m + diagonal − n|``, as :mod:`.band` and :mod:`.score_mod` define them for every backend
(the order of the cpp kernels: the cap, then the float mask and ALiBi are added, then masked pairs are ``-inf``).

All three are constexpr-gated (``WINDOW``, ``SOFTCAP``, ``ALIBI``): a launch without them compiles exactly the code
it had, so the spill table's other variants stay true. The band's sides are runtime ints clamped by the host to
``[-(M + 1), N + 1]`` (an unbounded side becomes one that holds every pair), so they fit int32 and one compiled
kernel serves every window.
"""
import math
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from attn_ext.ops.attention.band import Band
from attn_ext.ops.attention.triton_pairs import masked_scores

__all__ = ["ScoreArgs", "band_queries", "band_keys", "kernel_scores", "score_args", "scored_pairs", "tanh_f32"]

# The odd Taylor coefficients of tanh after x: -1/3, 2/15, -17/315, 62/2835, -1382/155925.
# (constexpr globals: a kernel reads no other)
_T3 = tl.constexpr(-1.0 / 3.0)
_T5 = tl.constexpr(2.0 / 15.0)
_T7 = tl.constexpr(-17.0 / 315.0)
_T9 = tl.constexpr(62.0 / 2835.0)
_T11 = tl.constexpr(-1382.0 / 155925.0)


@triton.jit
def tanh_f32(x):
    """``tanh`` of a float32 tile, within a few ulp everywhere, from ``exp`` and a series: one formula for the GPU
    and the interpreter (libdevice's ``tanh`` does not run under ``TRITON_INTERPRET=1``), so the interpreter tests
    test the GPU's arithmetic. ``(1 − e)/(1 + e)``, ``e = exp(−2|x|)``, loses ``1 − e`` to cancellation near 0,
    where the series to ``x¹¹`` is used (``|x| < 1/4``: its first omitted term is below ``2·10⁻¹⁰`` relative).
    ±inf gives ±1, NaN stays NaN."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    far = (1.0 - e) / (1.0 + e)
    a2 = a * a
    near = a * (1.0 + a2 * (_T3 + a2 * (_T5 + a2 * (_T7 + a2 * (_T9 + a2 * _T11)))))
    r = tl.where(a < 0.25, near, far)
    return tl.where(x < 0.0, -r, r)


@triton.jit
def scored_pairs(s, ATTN, sam, san, m2, n2, ok, band_lo, band_hi, softcap, slope, diagonal,
                 ATTN_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                 ALIBI: tl.constexpr):
    """``(scores, allowed, tanh)`` of the scaled dot products ``s`` of the pairs (``m2``, ``n2``) among ``ok``
    (broadcastable index tiles, as :func:`~.triton_pairs.masked_scores` takes them): capped (``tanh`` is
    ``tanh(s / c)``, the backward's factor ``1 − tanh²``; ``s`` itself without a cap), the float mask added, the
    pairs outside the band (``band_lo ≤ n − m ≤ band_hi``), the causal rule and the masks at ``-inf`` (the mask is
    not read outside the band), ALiBi subtracted."""
    t = s
    if SOFTCAP:
        t = tanh_f32(s * (1.0 / softcap))
        s = softcap * t
    if WINDOW:
        ok = ok & (n2 - m2 >= band_lo) & (n2 - m2 <= band_hi)
    s, allowed = masked_scores(s, ATTN, sam, san, m2, n2, ok, ATTN_MASK, IS_CAUSAL)
    if ALIBI:
        # -inf stays -inf; int64 where the diagonal offset is (a huge offset is legal)
        s = s - slope * tl.abs(m2 + diagonal - n2).to(tl.float32)
    return s, allowed, t


@triton.jit
def band_keys(m0, rows, N, band_lo, band_hi, BLOCK_N: tl.constexpr):
    """``[lo, hi)``: the key range the queries ``[m0, m0 + rows)`` may attend within the band, ``lo`` a multiple of
    ``BLOCK_N`` (aligned loads); empty when the band holds no key of theirs."""
    lo = tl.maximum(m0 + band_lo, 0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(m0 + rows - 1 + band_hi + 1, N)
    return lo, hi


@triton.jit
def band_queries(n0, keys, M, band_lo, band_hi, BLOCK_M: tl.constexpr):
    """``[lo, hi)``: the query range that may attend some key of ``[n0, n0 + keys)`` within the band, ``lo`` a
    multiple of ``BLOCK_M``."""
    lo = tl.maximum(n0 - band_hi, 0) // BLOCK_M * BLOCK_M
    hi = tl.minimum(n0 + keys - 1 - band_lo + 1, M)
    return lo, hi


# --------------------------------------------------------------------------- host side

class ScoreArgs(NamedTuple):
    """The kernels' runtime arguments ``band_lo, band_hi, softcap, SLOPES, diagonal`` and constexprs."""
    args: tuple
    meta: dict

    @property
    def window(self) -> bool:
        return self.meta["WINDOW"]


def score_args(band, softcap: float, alibi_slopes: Optional[torch.Tensor], diagonal: int, queries: int, keys: int,
               fallback: torch.Tensor) -> ScoreArgs:
    """The kernels' arguments of a call's band (:class:`~.band.Band`, None or the top-left causal rule: not a
    window: ``IS_CAUSAL`` has it), soft cap (0: none) and ALiBi slopes (float32 ``[B, Hq]``, or None), its sides
    clamped to ``[-(queries + 1), keys + 1]``."""
    window = band is not None and band.active

    def clamp(side, unbounded):
        return unbounded if side is None else max(-(queries + 1), min(keys + 1, int(side)))

    lo = clamp(band.lo, -(queries + 1)) if window else 0
    hi = clamp(band.hi, keys + 1) if window else 0
    slopes = fallback if alibi_slopes is None else alibi_slopes.contiguous()
    cap = float(softcap) if softcap and softcap > 0 else 1.0
    if not math.isfinite(cap):
        raise ValueError(f"attn_ext.scaled_dot_product_attention: softcap must be finite, got {softcap}")
    return ScoreArgs((lo, hi, cap, slopes, int(diagonal)),
                     dict(WINDOW=window, SOFTCAP=bool(softcap and softcap > 0), ALIBI=alibi_slopes is not None))


def kernel_scores(band, is_causal: bool, softcap: float, alibi_slopes: Optional[torch.Tensor], diagonal: int,
                  q: torch.Tensor, k: torch.Tensor) -> ScoreArgs:
    """The kernels' band and score arguments of a call: the top-left causal rule stays ``IS_CAUSAL`` (its split
    loop, its spill-table entries), any other band is a ``WINDOW`` that holds the causal rule too."""
    window = band if band.active and band != Band.of(is_causal) else None
    return score_args(window, softcap, alibi_slopes, diagonal, q.shape[2], k.shape[2], q)
